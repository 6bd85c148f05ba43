"""One budget per process for the response bytes it holds in memory (`limits.response_buffer`).

Each governed response of up to `max_stored_body` is read whole before it is stored (SPEC §2
step 4, §7); without a bound, two hundred 8 MiB answers at once hold 1.6 GB. Bytes are taken
from the budget as they are read (`try_take`, which never waits: a body that does not fit goes
to a temporary file instead, proxy/server/capture.py) and given back once they are written to the
client. A body on disk is read back into memory for its store write with `take`, which waits,
first come first served, until the budget has room. Only a caller that holds nothing waits, so
waiting cannot deadlock; a body larger than the whole budget is let through when nothing else
is held, so that it is stored rather than refused (the bound is then that body's size).

The budget never makes a request wait without bound (SPEC §9: never a reason to stall or refuse
a request): `take` waits at most `limits.response_buffer_wait`, then goes over the budget (an
overdraft, counted and logged), and a response being written to its client holds its bytes for
at most `limits.response_buffer_hold` (proxy/server/whole.py). A client that does not read can then
make the process hold more than the budget for a while, never freeze the answers of others.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
_LOG_EVERY = 60.0  # seconds between two log lines about overdrafts


class ResponseBudget:
    def __init__(
        self,
        limit: int,
        *,
        wait: float = 1.0,
        hold: float = 10.0,
        overdrawn: Callable[[], None] | None = None,
    ) -> None:
        self.limit = limit
        self.wait = wait  # the longest `take` waits for room
        self.hold = hold  # the longest a response being written holds its bytes
        self.used = 0
        self.overdrafts = 0
        self._overdrawn = overdrawn
        self._logged_at = -_LOG_EVERY
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def try_take(self, size: int) -> bool:
        """Take `size` bytes if they fit now and nobody waits for room before us."""
        if self._waiting or self.used + size > self.limit:
            return False
        self.used += size
        return True

    async def take(self, size: int) -> None:
        """Take `size` bytes, waiting for room first, at most `wait` seconds: then they are
        taken over the budget. The caller must hold nothing else."""
        if not self._waiting and self._fits(size):
            self.used += size
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.append((size, granted))
        try:
            # asyncio.wait, not a timeout: the future is left as it is when the time is up.
            await asyncio.wait((granted,), timeout=self.wait)
        except asyncio.CancelledError:
            if granted.done():
                self.give_back(size)  # granted just as the caller was cancelled
            else:
                granted.cancel()
                self._wake()  # the next in line may fit now that this one left
            raise
        if granted.done():
            return
        granted.cancel()  # left in the queue, skipped by _wake
        self.overdraw(size)

    def overdraw(self, size: int) -> None:
        """Take `size` bytes whether or not they fit: held for a bounded time, they are a
        softer bound than a request that waits for ever."""
        self.used += size
        self.overdrafts += 1
        if self._overdrawn is not None:
            self._overdrawn()
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY:
            self._logged_at = now
            log.warning(
                "response buffer full: %d bytes taken over limits.response_buffer (%d) after "
                "waiting %.1fs (%d such overdrafts so far); a client may not be reading",
                size,
                self.limit,
                self.wait,
                self.overdrafts,
            )
        self._wake()

    def give_back(self, size: int) -> None:
        self.used -= size
        if self._waiting:  # nobody waits for room: no call
            self._wake()

    def _fits(self, size: int) -> bool:
        return self.used == 0 or self.used + size <= self.limit

    def _wake(self) -> None:
        while self._waiting:
            size, granted = self._waiting[0]
            if granted.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            if not self._fits(size):
                return
            self._waiting.popleft()
            self.used += size
            granted.set_result(None)


class Held:
    """Bytes taken from a budget, given back exactly once (by whoever finishes first)."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: ResponseBudget, size: int = 0) -> None:
        self._budget = budget
        self.size = size

    def add(self, size: int) -> bool:
        if not self._budget.try_take(size):
            return False
        self.size += size
        return True

    def release(self) -> None:
        size, self.size = self.size, 0
        if size:
            self._budget.give_back(size)
