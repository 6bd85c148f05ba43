"""Which item a worker may start next, and when its attempts may go (SPEC §14, docs/batch.md).

`Admission` hands out the items in input order, each only once the budget has room for it at
its worst case (budget.py); `LimiterGate` puts each attempt of an item through the run's shared
rate limits (ratelimit.py) and tells them what the answer used, or that it asks to slow down.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from idemproxy.batch.budget import NOTHING, Budget
from idemproxy.batch.client import Answer
from idemproxy.batch.input import Item
from idemproxy.batch.keys import Identity
from idemproxy.batch.ratelimit import RateLimiter
from idemproxy.batch.stop import Stop
from idemproxy.batch.usage import UsagePointers, answer_tokens, estimate, worst_case


@dataclass(frozen=True)
class Admitted:
    item: Item
    identity: Identity
    tokens: int  # the estimate each attempt takes from `--tpm`


class Admission:
    """The queue of a run's items, admitted one at a time in order (an asyncio lock is fair)."""

    def __init__(
        self,
        work: Sequence[tuple[Item, Identity]],
        budget: Budget | None,
        assumed_output: int | None,
    ) -> None:
        self._queue = deque(work)
        self._budget = budget
        self._assumed_output = assumed_output or 0
        self._lock = asyncio.Lock()
        self._settled = asyncio.Event()
        self.exhausted: str | None = None  # why the budget stopped the run

    def __len__(self) -> int:
        return len(self._queue)

    async def next(self, stop: Stop) -> Admitted | None:
        """The next item to send, reserved in the budget; None when there is none to start."""
        async with self._lock:
            while self._queue and not stop.requested.is_set() and self.exhausted is None:
                item, identity = self._queue[0]
                if self._admit(item, identity.key):
                    self._queue.popleft()
                    return Admitted(item, identity, estimate(item).tokens(self._assumed_output))
                if self.exhausted is None:
                    await self._wait_for_settling(stop)
            return None

    def _admit(self, item: Item, key: str) -> bool:
        budget = self._budget
        if budget is None:
            return True
        if budget.counted(key):
            # Sent by an earlier run and never answered: its worst case is counted already, and
            # behind the proxy its key executes at most once. Its answer may make room.
            budget.reserve(item.id, NOTHING)
            return True
        charge = budget.at_worst(worst_case(item, self._assumed_output))
        if budget.fits(charge):
            budget.reserve(item.id, charge)
            return True
        if not budget.reserved:  # nothing in flight can make room: the budget is spent
            self.exhausted = (
                f"{budget.passed(budget.committed() + charge)}: {budget.describe(charge)} "
                f"(item {item.id!r}, line {item.line})"
            )
        return False

    async def _wait_for_settling(self, stop: Stop) -> None:
        self._settled.clear()
        settled = asyncio.ensure_future(self._settled.wait())
        stopping = asyncio.ensure_future(stop.requested.wait())
        try:
            await asyncio.wait({settled, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (settled, stopping):
                task.cancel()
            await asyncio.gather(settled, stopping, return_exceptions=True)

    def settle(self, item_id: str) -> None:
        """The item ended (its result is in the ledger, or it was abandoned)."""
        if self._budget is not None:
            self._budget.settle(item_id)
        self._settled.set()


@dataclass
class LimiterGate:
    """One item's attempts, under the run's shared limits (client.AttemptGate)."""

    limiter: RateLimiter
    tokens: int
    stop: Stop
    pointers: Sequence[UsagePointers]
    sent_before: bool = False  # an earlier run sent the item and had no answer
    held: int = 0  # the estimates of this run's tries that ended without an answer

    async def before_retry(self) -> bool:
        return await self.limiter.acquire(self.tokens, self.stop.requested)

    def after(self, answer: Answer | None) -> None:
        if answer is None:
            self.limiter.answered()
            self.held += self.tokens  # it may have used its tokens: the estimate stands
            return
        if answer.rate_limited:
            self.limiter.pause(answer.rate_limit_pause)
            self.limiter.correct(self.tokens, 0)  # refused: nothing was used
        elif answer.replayed and (self.held or self.sent_before):
            # SPEC §14: the answer of the execution a try of this batch started, unanswered:
            # it used what the answer says, counted once for this try and those.
            self._correct(answer, self.tokens + self.held)
            self.held = 0
        elif answer.replayed:
            self.limiter.correct(self.tokens, 0)  # answered by the proxy: the API saw nothing
        else:
            self._correct(answer, self.tokens)
        if not answer.rate_limited:
            self.limiter.answered()

    def _correct(self, answer: Answer, estimated: int) -> None:
        if not self.limiter.limits_tokens:
            return
        used = answer_tokens(answer.body, answer.content_type, self.pointers)
        if used is not None:
            self.limiter.correct(estimated, used)
