"""An identity provider's keys, held for the `jwt` owner strategy (SPEC §5): a `KeySource`.

Fetched once at start-up, then in the background every `refresh_interval` (sooner when the
provider's Cache-Control max-age says so), and when a token names a kid none of the keys held
has: a key rotated in since. Every fetch, whatever asks for it, is at most one per
`min_refresh_interval`, so a flood of tokens with forged kids costs the provider one request
per interval; one fetch runs at a time and every request waiting for keys shares it.

Nothing here blocks the event loop: a fetch is asynchronous, bounded by `timeout`, and a token
whose key is held is verified without waiting for anything. A request waits only for a kid it
does not know, and at most `timeout`.

A token with an unknown kid is `401` only when a key set that lacks it was fetched after the
token was signed: by a fetch started after the token arrived, or started (by the wall clock)
after its `iat` plus `owner.jwt.leeway` (the clocks of proxy and provider may differ that
much). Otherwise it may be good, signed with a key rotated in since: it waits for a fetch, or,
when the rate limit allows none yet, is `503 identity-unavailable` with `Retry-After` saying
when one will be (SPEC §5, §8), so that its retry is verified rather than refused.

When a fetch fails, the keys fetched before stay in use (a token with a known kid verifies as
before); a token with an unknown kid is then `503 identity-unavailable` (fail closed: it may be
good, so no 401, and it is never forwarded unscoped). Keys are kept however old they get (a
provider that is down must not take every owner down with it), but every failed refresh logs
their age, at error level once they are older than `STALE_KEYS_ERROR_SECONDS`. A failure at
start-up is one warning: the proxy serves, tokens are refused 503 and /readyz reports not ready
until a fetch succeeds, retried every `min_refresh_interval`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from idemproxy.config.settings import IdpSettings
from idemproxy.errors import IdentityUnavailable
from idemproxy.identity.jwt_keys import (
    FetchObserver,
    KeyRing,
    Refresh,
    VerificationKey,
    log_skipped,
    unobserved,
)
from idemproxy.proxy.idp.fetch import JwksClient, describe

log = logging.getLogger("idemproxy.owner")

# Keys kept through failed refreshes for longer than this are logged at error level: an
# identity provider unreachable for a day is an outage to act on, and a retired key still
# verifies meanwhile.
STALE_KEYS_ERROR_SECONDS = 24 * 3600.0


class RemoteKeys:
    """The key set of one identity provider, as the module docstring says it is kept."""

    def __init__(self, client: JwksClient, settings: IdpSettings) -> None:
        self._client = client
        self._refresh = settings.refresh_interval
        self._min_refresh = settings.min_refresh_interval
        self._timeout = settings.timeout
        self._ring: KeyRing | None = None
        self._fetched_ok = False  # whether the last fetch succeeded
        self._fetched_at: float | None = None  # loop time the last good key set came
        self._fetched_wall: float | None = None  # the same, by the wall clock (for `iat`)
        # JWKS entries left out, logged once while the provider keeps serving them.
        self._logged_skips: set[str] = set()
        self._last_attempt: float | None = None  # loop time the last fetch started
        self._next_refresh = 0.0
        self._inflight: asyncio.Task[bool] | None = None
        self._background: asyncio.Task[None] | None = None
        self._starting = False  # the first fetch: its failure is start()'s one warning
        self._last_error = ""
        self._observe: FetchObserver = unobserved

    # KeySource

    def select(self, kid: object) -> VerificationKey | None:
        return None if self._ring is None else self._ring.select(kid)

    def refresh_for(self, kid: object, signed_by: float | None = None) -> Refresh | None:
        if kid is not None and not isinstance(kid, str):
            return None  # no JWKS names a key that way (RFC 7517 §4.5)
        if self._covers(signed_by):
            return None  # keys fetched after the token was signed lack its kid: unknown
        arrived = self._now()
        return lambda: self._wait_for_keys(arrived, signed_by)

    async def start(self, observe: FetchObserver = unobserved) -> None:
        self._observe = observe
        await self._client.open()
        self._starting = True
        try:
            fetched = await self._fetch_task()
        finally:
            self._starting = False
        if not fetched:
            log.warning(
                "owner.jwt: no keys yet from %s: %s; tokens are answered 503"
                " identity-unavailable and /readyz is not ready until a fetch succeeds (retried"
                " every %gs)",
                self._client.source,
                self._last_error,
                self._min_refresh,
            )
        self._background = asyncio.get_running_loop().create_task(self._keep_fresh())

    async def close(self) -> None:
        for task in (self._background, self._inflight):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._client.close()

    def not_ready(self) -> str | None:
        if self._ring is not None:
            return None
        return f"owner.jwt: no keys fetched yet from {self._client.source}"

    # The fetches

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _may_fetch(self) -> bool:
        last = self._last_attempt
        return last is None or self._now() - last >= self._min_refresh

    def _fetch_task(self) -> asyncio.Task[bool]:
        """The fetch in flight, or a new one: never two at once."""
        if self._inflight is None:
            self._last_attempt = self._now()
            self._inflight = asyncio.get_running_loop().create_task(self._fetch())
        return self._inflight

    def _covers(self, signed_by: float | None, arrived: float | None = None) -> bool:
        """Whether the key set held was fetched after a token was surely signed: a fetch that
        started after the token `arrived` (loop time), or, by the wall clock, after
        `signed_by` (its iat plus the leeway)."""
        if self._ring is None or self._fetched_at is None or self._fetched_wall is None:
            return False
        if arrived is not None and self._fetched_at >= arrived:
            return True
        return signed_by is not None and self._fetched_wall >= signed_by

    def _unavailable(self) -> IdentityUnavailable:
        """503 with Retry-After: the seconds until the rate limit allows the next fetch."""
        last = self._last_attempt
        wait = 0.0 if last is None else last + self._min_refresh - self._now()
        return IdentityUnavailable(retry_after=max(1, math.ceil(wait)))

    async def _wait_for_keys(self, arrived: float, signed_by: float | None) -> None:
        """A request's wait for keys it lacks, until a key set fetched after it was signed
        came: at most `timeout`, at most one new fetch per `min_refresh_interval`;
        `IdentityUnavailable` when none came (the fetch failed, or none is allowed yet)."""
        try:
            async with asyncio.timeout(self._timeout):
                while not self._covers(signed_by, arrived):
                    if self._inflight is None and not self._may_fetch():
                        raise self._unavailable()
                    # Others may be waiting for the same fetch.
                    if not await asyncio.shield(self._fetch_task()):
                        raise self._unavailable()
        except TimeoutError as exc:
            raise IdentityUnavailable() from exc

    async def _fetch(self) -> bool:
        started, wall = self._now(), time.time()
        try:
            async with asyncio.timeout(self._timeout):
                fetched = await self._client.fetch()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure keeps the keys held (SPEC §5)
            self._failed(started, exc)
            self._observe(False)
            return False
        finally:
            self._inflight = None
        first = self._ring is None or not self._fetched_ok
        self._ring, self._fetched_ok, self._fetched_at = fetched.keys, True, started
        self._fetched_wall = wall
        log_skipped(fetched.keys, f"the keys from {self._client.source}", self._logged_skips)
        self._logged_skips = set(fetched.keys.skipped)  # those still served: bounded by one set
        fresh_for = self._refresh if fetched.max_age is None else fetched.max_age
        self._next_refresh = started + min(max(fresh_for, self._min_refresh), self._refresh)
        if first:
            log.info("owner.jwt: %d key(s) loaded from %s", fetched.keys.size, self._client.source)
        self._observe(True)
        return True

    def _failed(self, started: float, error: BaseException) -> None:
        self._fetched_ok = False
        self._next_refresh = started + self._min_refresh
        self._last_error = describe(error)
        if self._starting:
            return
        if self._ring is None or self._fetched_at is None:
            log.warning(
                "owner.jwt: fetching the keys from %s failed: %s; still no keys (retried every"
                " %gs)",
                self._client.source,
                self._last_error,
                self._min_refresh,
            )
            return
        age = started - self._fetched_at
        log.log(
            logging.ERROR if age >= STALE_KEYS_ERROR_SECONDS else logging.WARNING,
            "owner.jwt: refreshing the keys from %s failed: %s; keeping the %d key(s) fetched"
            " %.0fs ago",
            self._client.source,
            self._last_error,
            self._ring.size,
            age,
        )

    async def _keep_fresh(self) -> None:
        while True:
            delay = self._next_refresh - self._now()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            if self._inflight is None and not self._may_fetch():
                assert self._last_attempt is not None
                self._next_refresh = self._last_attempt + self._min_refresh
                continue
            await asyncio.shield(self._fetch_task())
