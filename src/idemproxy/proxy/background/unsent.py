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

The statements that start a later attempt after one that proved nothing executed
(`start_next_attempt`, `fail_over`; SPEC §3.4) are followed up the same way: the job must then be
in flight at the version and attempt count that statement set, with the token it recorded
(`started_by`), since another retry may have started an attempt of the same number.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import NamedTuple

from prometheus_client import Counter

from idemproxy.core.decision import Unsent, unsent_claim
from idemproxy.core.types import Job, JobState
from idemproxy.observe.metrics import UnsentOutcome
from idemproxy.proxy.background.followups import Ends, FollowUps
from idemproxy.store.ports import JobStore

log = logging.getLogger(__name__)
# Recorded on the attempt (SPEC §3.2 "failed"): what the operator reads in `jobs show`.
NEVER_FORWARDED = "started after its timeout; never forwarded"
# At most this many claims are watched; one more is counted as dropped (left to the operator).
MAX_UNSENT = 10_000


class _Claim(NamedTuple):
    owner: str
    key: str
    job_id: str
    # The job's version and attempt count once the statement committed: 1 and 1 for a claim,
    # one more of each than the job had for `start_next_attempt` and `fail_over`.
    version: int
    attempt: int
    token: str | None  # the statement's `started_by` (None for a claim: its job id tells)
    # time.monotonic() after which a claim that has not appeared is no longer looked for: its
    # lease ran from its statement's start, so had it committed later, it would be lease-expired
    # at once, and the next request would take it over.
    until: float


class UnsentClaims(FollowUps[_Claim, UnsentOutcome]):
    def __init__(
        self,
        store: JobStore,
        counted: Mapping[UnsentOutcome, Counter],
        *,
        lease: float,
        max_items: int = MAX_UNSENT,
    ) -> None:
        """`counted`: Metrics.unsent_outcome."""
        super().__init__(
            store,
            counted,
            ends=Ends(UnsentOutcome.DROPPED, UnsentOutcome.REFUSED, UnsentOutcome.MOVED_ON),
            max_items=max_items,
        )
        self._lease = lease

    def note(self, owner: str, key: str, job_id: str) -> None:
        """A claim under `job_id` failed: nothing was forwarded under it."""
        self._add(job_id, _Claim(owner, key, job_id, 1, 1, None, time.monotonic() + self._lease))

    def note_next(self, job: Job, token: str) -> None:
        """`start_next_attempt` or `fail_over` from `job` (as read before it) failed: the attempt
        it would have started was never forwarded. The same cleanup as a claim's (SPEC §3.4: the
        attempt before it proved nothing executed)."""
        claim = _Claim(
            job.owner,
            job.key,
            job.id,
            job.version + 1,
            job.attempt_count + 1,
            token,
            time.monotonic() + self._lease,
        )
        self._add(job.id, claim)

    async def _settle(self, store: JobStore, claim: _Claim) -> UnsentOutcome | None:
        job = await store.get(claim.owner, claim.key)
        verdict = unsent_claim(
            job, claim.job_id, version=claim.version, attempt=claim.attempt, token=claim.token
        )
        if verdict is Unsent.NOT_YET:
            return UnsentOutcome.NOT_COMMITTED if time.monotonic() >= claim.until else None
        released = (
            verdict is Unsent.RELEASE
            and job is not None
            and await store.settle(job, claim.attempt, JobState.RELEASED, error=NEVER_FORWARDED)
        )
        if not released:
            return UnsentOutcome.MOVED_ON
        log.warning(
            "job %s released: its attempt %d started after the proxy had answered 503, and "
            "nothing was forwarded",
            claim.job_id,
            claim.attempt,
        )
        return UnsentOutcome.RELEASED
