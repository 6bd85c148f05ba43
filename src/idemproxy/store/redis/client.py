"""The one boundary to Redis (its errors are translated here and nowhere else): every call bounded
in time, every failure a cache miss.

Redis is never the source of truth (SPEC §11). A lookup that fails or takes longer than
`timeout` is a miss and the request goes to the store. Writes and wake-ups run in the
background, bounded by `write_timeout`, and never fail or slow a request. After any error the
cache is bypassed for `REDIS_RETRY_SECONDS`: a Redis that is down or stalled costs one timeout
per probe, not one per request, and is used again as soon as a probe succeeds.

Invalidations are not best effort. One that cannot reach Redis is kept and retried by the feed
every tick, and until it has gone through this process reads nothing from the cache. A cache
write checks the job's tombstone in the script that writes, so a write that lands after the job
was deleted is refused (see docs/operations.md, "Redis").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from idemproxy.constants import REDIS_CHANNEL, REDIS_RETRY_SECONDS, REDIS_WATCH_SECONDS

log = logging.getLogger("idemproxy.store.redis")
REDIS_ERRORS = (RedisError, OSError, TimeoutError)
# Cache writes queued at once; beyond this a write is skipped (a later miss re-caches the job).
_MAX_BACKGROUND = 512


class EntryKeys(NamedTuple):
    """The keys a cache write touches (store/redis/codec.py names them)."""

    entry: str
    tombstone: str  # the job's: set once it was deleted, and then the write is refused
    watch: str  # the key's watch mark: set while a duplicate is held somewhere


# KEYS: entry, the job's tombstone, the key's watch mark. ARGV: payload, ttl ms, channel, job
# id to announce ('' for none): only if a duplicate is held somewhere (the watch mark is set).
_PUT = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
if ARGV[4] ~= '' and redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('PUBLISH', ARGV[3], ARGV[4])
end
return 1
"""
# KEYS: the key's watch mark. ARGV: channel, job id.
_ANNOUNCE = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PUBLISH', ARGV[1], ARGV[2]) end
return 1
"""
# KEYS: entry, the job's tombstone. ARGV: tombstone ttl ms (0: no tombstone needed).
_DROP = """
if tonumber(ARGV[1]) > 0 then redis.call('SET', KEYS[2], '1', 'PX', ARGV[1]) end
redis.call('DEL', KEYS[1])
return 1
"""


def connect(url: str, *, timeout: float) -> Redis:
    """A client (connecting lazily) whose every socket operation is bounded by `timeout`."""
    return Redis.from_url(
        url,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        retry=Retry(NoBackoff(), 0),  # no retries: a failure is a miss, and the store answers
    )


# Entries named in the warning of invalidations left at exit (a purge may leave thousands).
_NAMED = 20


class CacheDown(Exception):
    """Redis failed or answered too late; the caller treats it as a miss."""


class RedisCache:
    def __init__(self, client: Redis, *, timeout: float, write_timeout: float) -> None:
        self.client = client
        self._timeout = timeout
        self._write_timeout = write_timeout
        self._down_until = 0.0
        self._outage = False
        # (entry, tombstone) → Unix time until which the tombstone must live (None: no tombstone)
        self._drops: dict[tuple[str, str], float | None] = {}
        # Invalidations asked for so far, and the count when each pending one was last asked
        # for: what one operator's change left pending (`pending_since`).
        self.drops_made = 0
        self._made: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def readable(self) -> bool:
        """False while Redis is presumed down or an invalidation has not reached it."""
        return not self._drops and time.monotonic() >= self._down_until

    @property
    def up(self) -> bool:
        """Whether Redis answered the last call (False from an error until one succeeds)."""
        return not self._outage

    @property
    def pending_drops(self) -> int:
        """Invalidations not yet through to Redis: no lookup reads it until they are."""
        return len(self._drops)

    @property
    def pending_entries(self) -> list[str]:
        """The entries whose invalidation has not reached Redis, by name."""
        return self.pending_between(0, self.drops_made)

    def pending_between(self, since: int, until: int) -> list[str]:
        """The entries pending among those whose invalidation was asked for after `since` and
        up to `until` (values of `drops_made`), by name."""
        return sorted({entry for (entry, _), made in self._made.items() if since < made <= until})

    @property
    def has_drops(self) -> bool:
        return bool(self._drops)

    async def get(self, name: str) -> bytes | None:
        if not self.readable:
            return None
        try:
            async with self._bounded("lookup", self._timeout):
                value = await self.client.get(name)
        except CacheDown:
            return None
        return value if isinstance(value, bytes) else None

    def put(self, keys: EntryKeys, payload: bytes, ttl: float, announce: str) -> None:
        """In the background: write the entry unless the job is tombstoned, and announce the
        job id `announce` ('' for none) if its key is watched."""
        args = (payload, max(1, int(ttl * 1000)), REDIS_CHANNEL, announce)
        self._spawn(self._quietly("write", lambda: self.client.eval(_PUT, 3, *keys, *args)))

    def announce(self, watch: str, job_id: str) -> None:
        """In the background: wake the held duplicates of a job, on every replica, if any."""
        call = lambda: self.client.eval(_ANNOUNCE, 1, watch, REDIS_CHANNEL, job_id)  # noqa: E731
        self._spawn(self._quietly("publish", call))

    async def watching(self, watch: str) -> None:
        """Mark a key watched before its job is re-read (so a change after the re-read is
        announced); within the lookup timeout, and skipped while Redis is presumed down."""
        if time.monotonic() < self._down_until:
            return
        with contextlib.suppress(CacheDown):
            async with self._bounded("watch", self._timeout):
                await self.client.set(watch, b"1", ex=REDIS_WATCH_SECONDS)

    async def drop(self, name: str, tombstone: str, until: float | None) -> None:
        """Invalidate an entry now, tombstoning its job until `until` (Unix time); if Redis
        cannot take it, keep it pending and retry."""
        self._drops[name, tombstone] = until
        self._asked((name, tombstone))
        await self.flush_drops()

    def drop_soon(self, name: str, tombstone: str) -> None:
        """Invalidate an entry in the background (no tombstone), or keep it pending."""
        self._drops.setdefault((name, tombstone), None)
        self._asked((name, tombstone))
        self._spawn(self._flush_quietly())

    def _asked(self, drop: tuple[str, str]) -> None:
        self.drops_made += 1
        self._made[drop] = self.drops_made

    async def flush_drops(self) -> bool:
        """Send every pending invalidation; False when Redis could not take them all."""
        for pending, until in list(self._drops.items()):
            ms = 0 if until is None else max(0, int((until - time.time()) * 1000))
            try:
                async with self._bounded("invalidate", self._write_timeout):
                    await self.client.eval(_DROP, 2, *pending, ms)
            except CacheDown:
                return False
            self._drops.pop(pending, None)
            self._made.pop(pending, None)
        return True

    async def drain(self) -> None:
        """Let the background writes finish (each is bounded by `write_timeout`)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._write_timeout)

    async def close(self) -> None:
        await self.drain()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if not await self.flush_drops():
            # SPEC §11: what an operator must unlink by hand, if Redis keeps its data
            names = self.pending_entries
            shown = " ".join(names[:_NAMED]) + (" …" if len(names) > _NAMED else "")
            log.warning("redis: %d cache invalidations could not be sent: %s", len(names), shown)
        with contextlib.suppress(*REDIS_ERRORS):
            async with asyncio.timeout(self._write_timeout):
                await self.client.aclose()

    def lost(self, what: str, exc: BaseException) -> None:
        """Redis failed: bypass it for a while (logged once per outage)."""
        self._down_until = time.monotonic() + REDIS_RETRY_SECONDS
        if not self._outage:
            self._outage = True
            log.warning(
                "redis unavailable during %s (%s); serving from the store alone until it is back",
                what,
                type(exc).__name__,
            )

    def back(self) -> None:
        self._down_until = 0.0
        if self._outage:
            self._outage = False
            log.info("redis is back: the replay cache is in use again")

    @contextlib.asynccontextmanager
    async def _bounded(self, what: str, timeout: float) -> AsyncIterator[None]:
        """The translation boundary: any Redis error or a late answer becomes `CacheDown`."""
        try:
            async with asyncio.timeout(timeout):
                yield
        except REDIS_ERRORS as exc:
            if not _wrong_type(exc):
                self.lost(what, exc)
            raise CacheDown(what) from exc
        self.back()

    async def _quietly(self, what: str, call: Callable[[], Awaitable[Any]]) -> None:
        if time.monotonic() < self._down_until:
            return  # a background write to a Redis presumed down would only queue up
        with contextlib.suppress(CacheDown):
            async with self._bounded(what, self._write_timeout):
                await call()

    async def _flush_quietly(self) -> None:
        await self.flush_drops()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        if len(self._tasks) >= _MAX_BACKGROUND:
            coro.close()
            return
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _wrong_type(exc: BaseException) -> bool:
    """Redis answered, about one key alone: a value of another type under an entry's name (put
    there by another program, or by hand). A miss for that key, which the next write replaces;
    not an outage that would turn the cache off for every key."""
    return isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE")
