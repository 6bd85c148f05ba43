"""Store writes that failed and are finished later, once the store answers again: the loop that
proxy/background/unsent.py (claims that committed after their 503) and proxy/background/unwritten.py
(attempt outcomes the store could not take) share.

Each item is keyed by its job id and tried in the background, first after 50 ms, then with a
pause that doubles up to 1 s while the store stays away or the item is not settled yet. Every
write it makes is a compare-and-swap on the job's version, so a late one changes nothing once
the job moved on. At most `max_items` items (and `max_bytes` of responses) are held per process;
one more is counted as dropped and left to the lease and the operator, as before.

While the store is away (`StoreUnavailable`) a round stops at the first item: every other try
would fail the same way. An item the store refuses for its data (`StoreRefused`, a value that
PostgreSQL's jsonb would not take) is final: logged, counted as refused and dropped. One whose
try raises (a bug) is logged and tried again in the next round. Either way the round goes on
with the next item.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
from collections.abc import Mapping
from typing import Generic, NamedTuple, TypeVar

from prometheus_client import Counter

from idemproxy.errors import StoreRefused, StoreUnavailable
from idemproxy.store.ports import JobStore

log = logging.getLogger(__name__)
# Seconds between rounds, doubling while the store stays away or nothing was settled.
_FIRST_PAUSE, _LAST_PAUSE = 0.05, 1.0

Item = TypeVar("Item")
Done = TypeVar("Done", bound=enum.StrEnum)  # what became of an item: a metric's label value


class Ends(NamedTuple, Generic[Done]):
    """The outcomes every kind of follow-up counts the same way."""

    dropped: Done  # one more item than this process holds
    refused: Done  # the store refused the write for its data
    moved_on: Done  # another item for the same job took its place


class FollowUps(abc.ABC, Generic[Item, Done]):
    def __init__(
        self,
        store: JobStore,
        counted: Mapping[Done, Counter],
        *,
        ends: Ends[Done],
        max_items: int,
        max_bytes: int = 0,
    ) -> None:
        """`counted`: a counter by outcome (one of Metrics' `Children`), the `ends` among
        them."""
        self._store = store
        self._counted = counted
        self._dropped, self._refused, self._moved_on = ends
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._bytes = 0
        self._pending: dict[str, Item] = {}
        self._task: asyncio.Task[None] | None = None
        # The item whose write is under way: one that replaces it leaves it to be counted
        # by that write's own outcome.
        self._writing: Item | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def _add(self, job_id: str, item: Item) -> None:
        """Hold `item` for its job. One item per job is held: a newer one takes the older one's
        place unless the older is to be kept (`_keeps`); the one left out is counted as moved
        on, since the job moved on from it (one whose write is under way is counted by that
        write's own outcome instead)."""
        older = self._pending.get(job_id)
        if older is not None:
            kept = self._keeps(older, item)
            left_out = item if kept else older
            if left_out is not self._writing:
                self._ended_as(left_out, self._moved_on)
            if kept:
                return
            self._drop(job_id)
        size = self._size(item)
        over_bytes = self._max_bytes and self._bytes + size > self._max_bytes
        if len(self._pending) >= self._max_items or over_bytes:
            self._ended_as(item, self._dropped)
            return
        self._pending[job_id] = item
        self._bytes += size
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._until_settled())

    async def close(self, grace: float = 0.0) -> None:
        """Stop. What is still held gets one more chance, tried at once and then as before for
        at most `grace` seconds: on a shutdown the store is usually there, and an item dropped
        here (counted as dropped) leaves its job to the lease, `unknown` (SPEC §3.5): a result
        lost, or a key no retry may run although nothing was forwarded under it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pending and grace > 0:
            await self._until_settled(
                first_pause=0.0, until=asyncio.get_running_loop().time() + grace
            )
        if self._pending:
            log.warning(
                "%d follow-up(s) left unwritten at shutdown, their jobs to the lease: %s",
                len(self._pending),
                ", ".join(sorted(self._pending)[:10]),
            )
            # Counted as dropped, as one more than the process holds is: every item ends
            # counted once, this process's last scrape included.
            for job_id in list(self._pending):
                item = self._pending[job_id]
                self._drop(job_id)
                self._ended_as(item, self._dropped)

    # --- what each kind defines ---------------------------------------------------------------

    @abc.abstractmethod
    async def _settle(self, store: JobStore, item: Item) -> Done | None:
        """One try: the outcome to count when the item is done, None to try again later.
        StoreUnavailable: the store is still away."""

    def _size(self, item: Item) -> int:
        return 0

    def _keeps(self, older: Item, newer: Item) -> bool:
        """Whether `older`, held for a job, stays in the place of `newer` for the same job;
        by default the newer takes its place (the later statement is the job's)."""
        return False

    def _ended(self, item: Item, outcome: Done) -> None:
        """What else an item's end is told to (counted as `outcome`); nothing by default."""

    # --- the loop -----------------------------------------------------------------------------

    def _ended_as(self, item: Item, outcome: Done) -> None:
        self._counted[outcome].inc()
        self._ended(item, outcome)

    def _drop(self, job_id: str) -> None:
        item = self._pending.pop(job_id, None)
        if item is not None:
            self._bytes -= self._size(item)

    async def _until_settled(
        self, first_pause: float = _FIRST_PAUSE, until: float | None = None
    ) -> None:
        """Rounds until nothing is pending, or until the loop's clock reaches `until` (no try
        starts after it, and one under way is cut there)."""
        loop = asyncio.get_running_loop()
        pause, wait = _FIRST_PAUSE, first_pause
        while self._pending:
            if until is not None:
                wait = min(wait, until - loop.time())
                if wait < 0:
                    return
            await asyncio.sleep(wait)
            settled = await self._round(until)
            pause = _FIRST_PAUSE if settled else min(pause * 2, _LAST_PAUSE)
            wait = pause

    async def _round(self, until: float | None) -> bool:
        """One try of every item held, up to the first the store is away for; whether any
        was settled."""
        settled = False
        for job_id, item in list(self._pending.items()):
            if self._pending.get(job_id) is not item:
                continue  # replaced during this round, and counted then (`_add`)
            try:
                if until is None:
                    outcome = await self._try(job_id, item)
                else:
                    async with asyncio.timeout_at(until):
                        outcome = await self._try(job_id, item)
            except (StoreUnavailable, TimeoutError):
                break  # still away (every other try would fail the same way), or out of time
            if outcome is not None:
                if self._pending.get(job_id) is item:  # else replaced while it was written
                    self._drop(job_id)
                self._ended_as(item, outcome)
                settled = True
        return settled

    async def _try(self, job_id: str, item: Item) -> Done | None:
        """`_settle`, with the errors that are final for this item made its outcome: the
        others are still tried (one item the store refuses held up every one behind it)."""
        self._writing = item
        try:
            return await self._settle(self._store, item)
        except StoreRefused:
            # The store answered and refused this write (its data): never written, whatever
            # the wait. Its job is left to the lease and the operator (SPEC §3.5).
            log.error("the follow-up of job %s was refused by the store; given up", job_id)
            return self._refused
        except StoreUnavailable:
            raise
        except Exception:  # a bug: loud, and this item is tried again later (the others now)
            log.exception("the follow-up of job %s failed", job_id)
            return None
        finally:
            self._writing = None
