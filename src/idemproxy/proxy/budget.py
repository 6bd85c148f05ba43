"""One budget per process for the response bytes it holds in memory (`limits.response_buffer`).

Each governed response of up to `max_stored_body` is read whole before it is stored (SPEC §2
step 4, §7); without a bound, two hundred 8 MiB answers at once hold 1.6 GB. Bytes are taken
from the budget as they are read (`try_take`, which never waits: a body that does not fit goes
to a temporary file instead, proxy/capture.py) and given back once they are written to the
client. A body on disk is read back into memory for its store write with `take`, which waits,
first come first served, until the budget has room. Only a caller that holds nothing waits, so
waiting cannot deadlock; a body larger than the whole budget is let through when nothing else
is held, so that it is stored rather than refused (the bound is then that body's size).
"""

from __future__ import annotations

import asyncio
import collections


class ResponseBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def try_take(self, size: int) -> bool:
        """Take `size` bytes if they fit now and nobody waits for room before us."""
        if self._waiting or self.used + size > self.limit:
            return False
        self.used += size
        return True

    async def take(self, size: int) -> None:
        """Take `size` bytes, waiting for room first. The caller must hold nothing else."""
        if not self._waiting and self._fits(size):
            self.used += size
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.append((size, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.give_back(size)  # granted just as the caller was cancelled
            else:
                self._wake()  # the next in line may fit now that this one left
            raise

    def give_back(self, size: int) -> None:
        self.used -= size
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
