"""Claims this process gave up on, released once the store answers again (SPEC §2.2, §3.1).

A claim sent to a stalled store times out and its client gets `503 store-unavailable`: nothing
was forwarded. The stalled server may still commit that claim once it runs again (it has the
whole statement, and commits it whether or not the proxy still listens), leaving a job
`in_flight` that nobody runs. After its lease the next request would take it over as `unknown`,
and every retry would get `409 outcome-unknown` until an operator released it: after a store
stall of a second or two, one such job for every claim that was waiting.

This process knows what the store cannot: it never forwarded those requests. So it remembers
the job id of each claim that failed, and until that claim's lease would have run out it looks
the key up (backing off while the store is still away). If the job under the key is that
claim, untouched (`decision.unsent_claim`), it settles it `released` with the same
compare-and-swap an attempt uses when its upstream refused the connection; the duplicates held
behind it wake up and the next one runs. A job already taken over as `unknown` is left to the
operator (docs/operations.md, "A claim that commits after its 503").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import NamedTuple

from prometheus_client import Counter

from idemproxy.decision import Unsent, unsent_claim
from idemproxy.errors import StoreUnavailable
from idemproxy.store.base import Store
from idemproxy.types import JobState

log = logging.getLogger(__name__)
# Recorded on the attempt (SPEC §3.2 "failed"): what the operator reads in `jobs show`.
NEVER_FORWARDED = "claim committed after its timeout; never forwarded"
# At most this many claims are watched; one more is counted as dropped (left to the operator).
MAX_UNSENT = 10_000
# Seconds between looks, doubling while the store stays away or the claim has not appeared.
_FIRST_LOOK, _LAST_LOOK = 0.05, 1.0


class _Claim(NamedTuple):
    owner: str
    key: str
    job_id: str
    # time.monotonic() after which a claim that has not appeared is no longer looked for: its
    # lease ran from its statement's start, so had it committed later, it would be lease-expired
    # at once, and the next request would take it over.
    until: float


class UnsentClaims:
    def __init__(self, store: Store, counted: Mapping[str, Counter], *, lease: float) -> None:
        """`counted`: a counter by outcome (Metrics.unsent_outcome, metrics.UNSENT_OUTCOMES)."""
        self._store = store
        self._counted = counted
        self._lease = lease
        self._pending: dict[str, _Claim] = {}
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def note(self, owner: str, key: str, job_id: str) -> None:
        """A claim under `job_id` failed: nothing was forwarded under it."""
        if len(self._pending) >= MAX_UNSENT:
            self._counted["dropped"].inc()
            return
        until = time.monotonic() + self._lease
        self._pending[job_id] = _Claim(owner, key, job_id, until)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._look_until_settled())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _look_until_settled(self) -> None:
        pause = _FIRST_LOOK
        while self._pending:
            await asyncio.sleep(pause)
            progressed = False
            for claim in list(self._pending.values()):
                try:
                    done = await self._look(claim)
                except StoreUnavailable:
                    break  # still away: every other look would fail the same way
                except Exception:  # a bug: loud, and the claim is looked for again later
                    log.exception("looking up the unsent claim of job %s failed", claim.job_id)
                    break
                progressed = progressed or done
                if done or time.monotonic() >= claim.until:
                    del self._pending[claim.job_id]
                    if not done:
                        self._counted["not_committed"].inc()
            pause = _FIRST_LOOK if progressed else min(pause * 2, _LAST_LOOK)

    async def _look(self, claim: _Claim) -> bool:
        """Whether this claim is settled for good (released, or never ours to release)."""
        job = await self._store.get(claim.owner, claim.key)
        verdict = unsent_claim(job, claim.job_id)
        if verdict is Unsent.NOT_YET:
            return False
        if verdict is Unsent.RELEASE and job is not None:
            released = await self._store.settle(job, 1, JobState.RELEASED, error=NEVER_FORWARDED)
            if released:
                self._counted["released"].inc()
                log.warning(
                    "job %s released: its claim committed after the proxy had answered 503, "
                    "and nothing was forwarded",
                    job.id,
                )
                return True
        self._counted["moved_on"].inc()
        return True
