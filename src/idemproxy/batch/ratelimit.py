"""Rate limits shared by all the workers of a run: `--rpm`, `--tpm`, and the server's 429s.

Each limit is a token bucket refilled continuously at limit/60 per second and holding at most a
second's worth (at least one request, or one item's tokens): providers enforce per-minute limits
over shorter periods too, so a minute's worth sent in a burst would be refused. An item larger
than the bucket waits for a full bucket and leaves it in debt, so the rate over time stays the
limit. Tokens are taken at the item's estimate before each attempt (usage.py) and corrected when
the answer says what it used: a replay, or a 429 or 503, used none.

A `429` or `503` that is not a replay pauses every worker, not only the one that got it, for
what the answer asks — `Retry-After` (seconds or an HTTP date, RFC 9110 §10.2.3),
`retry-after-ms`, or the `x-ratelimit-reset-requests` / `x-ratelimit-reset-tokens` durations
(`6m0s`, `1s`, `20ms`) of the limit that ran out — capped at `RETRY_AFTER_CAP_SECONDS`, or
`DEFAULT_PAUSE_SECONDS` when it asks nothing. When the pause ends one request goes first, and
the others wait for an answer (at most `PROBE_WAIT_SECONDS`) before they follow: all the workers
coming back at once would only be refused together again. Waits are computed, never polled, and
end early when the run is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from idemproxy.batch.constants import RETRY_AFTER_CAP_SECONDS
from idemproxy.batch.outcome import retry_after_seconds

Clock = Callable[[], float]

DEFAULT_PAUSE_SECONDS = 1.0
PROBE_WAIT_SECONDS = 5.0
RATE_LIMITED_STATUSES = frozenset({429, 503})
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s|us|µs|ns)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass
class TokenBucket:
    """Pure arithmetic: `per_minute` units, refilled continuously, at most `capacity` saved."""

    per_minute: float
    now: float  # the clock reading `level` is for
    level: float = field(init=False)

    def __post_init__(self) -> None:
        if self.per_minute <= 0:
            raise ValueError("a rate limit must be > 0")
        self.level = self.capacity

    @property
    def rate(self) -> float:  # units per second
        return self.per_minute / 60.0

    @property
    def capacity(self) -> float:
        return max(1.0, self.rate)

    def refill(self, now: float) -> None:
        if now > self.now:
            self.level = min(self.capacity, self.level + (now - self.now) * self.rate)
            self.now = now

    def wait(self, amount: float, now: float) -> float:
        """Seconds until `amount` may be taken (0: now). More than the bucket holds waits for a
        full bucket."""
        self.refill(now)
        needed = min(amount, self.capacity)
        return 0.0 if self.level >= needed else (needed - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount  # may go below zero: the debt of an item larger than the bucket

    def give_back(self, amount: float, now: float) -> None:
        """Correct an estimate: `amount` > 0 returns what was not used, < 0 takes the excess."""
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


def parse_duration(value: str) -> float | None:
    """A Go-style duration as OpenAI sends them (`6m0s`, `1s`, `20ms`, `1h2m3.5s`) or plain
    seconds; None when unreadable."""
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        return None
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def pause_seconds(headers: Mapping[str, str]) -> float | None:
    """How long a rate-limited answer asks the client to wait; None when it does not say.

    `Retry-After` (or the millisecond `retry-after-ms`) is the server's exact request. Without
    it, the `x-ratelimit-reset-*` of each limit that ran out (its `x-ratelimit-remaining-*` is
    0, or not given) says when it is back; when none ran out, the soonest reset.
    """
    headers = {name.lower(): value for name, value in headers.items()}
    millis = headers.get("retry-after-ms")
    if millis is not None:
        value = parse_duration(millis)
        if value is not None:
            return min(value / 1000.0, RETRY_AFTER_CAP_SECONDS)
    retry_after = retry_after_seconds(headers.get("retry-after"))
    if retry_after is not None:
        return retry_after
    resets: dict[str, float] = {}
    for limit in ("requests", "tokens"):
        raw = headers.get(f"x-ratelimit-reset-{limit}")
        value = parse_duration(raw) if raw is not None else None
        if value is not None:
            resets[limit] = value
    if not resets:
        return None
    exhausted = [value for limit, value in resets.items() if _ran_out(headers, limit)]
    wait = max(exhausted) if exhausted else min(resets.values())
    return min(wait, RETRY_AFTER_CAP_SECONDS)


def _ran_out(headers: Mapping[str, str], limit: str) -> bool:
    remaining = headers.get(f"x-ratelimit-remaining-{limit}")
    if remaining is None:
        return True
    try:
        return float(remaining) <= 0
    except ValueError:
        return True


class RateLimiter:
    """The buckets and the pause of one run, for all its workers (one asyncio loop).

    Waiters are served in arrival order (an asyncio lock is fair), each sleeping exactly until
    its request and tokens are available or the pause ends.
    """

    def __init__(
        self,
        rpm: float | None = None,
        tpm: float | None = None,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self._clock = clock
        now = clock()
        self.requests = TokenBucket(rpm, now) if rpm else None
        self.tokens = TokenBucket(tpm, now) if tpm else None
        self.paused_until = now
        self.pauses = 0  # rate-limited answers that paused the run
        self._lock = asyncio.Lock()
        self._probing = False  # the next request to go is the first after a pause
        self._probe: asyncio.Event | None = None  # set once an answer came after it went

    @property
    def limits_tokens(self) -> bool:
        return self.tokens is not None

    def delay(self, tokens: int) -> float:
        """Seconds before a request of `tokens` may go (pure, given the clock)."""
        now = self._clock()
        wait = max(0.0, self.paused_until - now)
        if self.requests is not None:
            wait = max(wait, self.requests.wait(1, now))
        if self.tokens is not None:
            wait = max(wait, self.tokens.wait(tokens, now))
        return wait

    async def acquire(self, tokens: int, stop: asyncio.Event | None = None) -> bool:
        """Wait for the go-ahead and take one request and `tokens`; False if stopped first."""
        async with self._lock:
            while True:
                wait = self.delay(tokens)
                probe = self._probe
                if wait > 0:
                    stopped = await _stopped_within(stop, _sleep(wait))
                elif probe is not None and not probe.is_set():
                    stopped = await _stopped_within(stop, _probe_answered(probe))
                else:
                    break
                if stopped:
                    return False
            if stop is not None and stop.is_set():
                return False
            self._take(tokens)
            return True

    def _take(self, tokens: int) -> None:
        now = self._clock()
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            self.tokens.take(tokens, now)
        if self._probing:
            self._probing, self._probe = False, asyncio.Event()

    def answered(self) -> None:
        """An answer came (or an attempt ended without one): the requests after a pause go."""
        if self._probe is not None:
            self._probe.set()
            self._probe = None

    def correct(self, estimated: int, used: int) -> None:
        """An attempt took `estimated` tokens and the answer says it used `used`."""
        if self.tokens is not None:
            self.tokens.give_back(estimated - used, self._clock())

    def pause(self, seconds: float | None) -> float:
        """Hold every worker for `seconds` (the default when None) from now; the pause."""
        wait = DEFAULT_PAUSE_SECONDS if seconds is None else min(seconds, RETRY_AFTER_CAP_SECONDS)
        self.paused_until = max(self.paused_until, self._clock() + wait)
        self.pauses += 1
        self.answered()  # whoever waits for an earlier probe now waits for the pause
        self._probing = True
        return wait


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def _probe_answered(probe: asyncio.Event) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(probe.wait(), timeout=PROBE_WAIT_SECONDS)


async def _stopped_within(stop: asyncio.Event | None, waiting: Coroutine[Any, Any, None]) -> bool:
    """Await `waiting` unless `stop` is set first; whether it was."""
    if stop is None:
        await waiting
        return False
    task = asyncio.ensure_future(waiting)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, stopping):
            pending.cancel()
        await asyncio.gather(task, stopping, return_exceptions=True)
    return stop.is_set()
