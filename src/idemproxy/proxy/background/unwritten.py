"""Attempt outcomes the store could not take, written once it answers again (SPEC §2.4, §3.5).

The upstream answered (or failed) and the proxy could not store that outcome: the store went
away or the statement timed out, and the client got `503 store-unavailable` saying the request
was forwarded. The job then stayed `in_flight` until its lease ran out, and the next request took
it over as `unknown`, an operator task, although this process held the very response.

Now the process keeps the outcome and writes it in the background as soon as the store answers
(proxy/background/followups.py). Each write is the attempt's own compare-and-swap on the version it
ran under: it wins only while the job is still that attempt's, in flight and not completed, so a
job taken over in the meantime stays `unknown` (SPEC §3.3), and a first try that did commit
after all makes the retry lose, with the same response stored. A duplicate held behind the job
then gets the stored response as a replay, and a later retry too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

from prometheus_client import Counter

from idemproxy.core.types import Job, JobState, StoredResponse
from idemproxy.observe.metrics import AttemptOutcome, CounterSeries, UnwrittenOutcome
from idemproxy.proxy.background.followups import Ends, FollowUps
from idemproxy.store.ports import JobStore

log = logging.getLogger(__name__)
# At most this many outcomes, and this many bytes of responses, wait per process; one more is
# counted as dropped, and its job becomes unknown after its lease as before.
MAX_UNWRITTEN = 1_000
MAX_UNWRITTEN_BYTES = 64 << 20


class _Outcome(NamedTuple):
    job: Job
    attempt: int
    # A completion (SPEC §3.2 succeeded) or a settlement (released or unknown), not both.
    response: StoredResponse | None
    ttl: float
    state: JobState
    status: int | None
    error: str | None


# How an attempt whose completion waited here ended (`idemproxy_attempts_total`): its result
# stored; the job gone on without it (taken over, or completed by another attempt); or never
# written, so that its lease runs out and the job becomes unknown (SPEC §3.5).
_ATTEMPT_ENDED = {
    UnwrittenOutcome.WRITTEN: AttemptOutcome.SUCCEEDED,
    UnwrittenOutcome.MOVED_ON: AttemptOutcome.DISCARDED,
    UnwrittenOutcome.DROPPED: AttemptOutcome.UNKNOWN,
    UnwrittenOutcome.REFUSED: AttemptOutcome.UNKNOWN,
}


class UnwrittenOutcomes(FollowUps[_Outcome, UnwrittenOutcome]):
    def __init__(
        self,
        store: JobStore,
        counted: Mapping[UnwrittenOutcome, Counter],
        attempts: Mapping[AttemptOutcome, CounterSeries] | None = None,
        late: Counter | None = None,
    ) -> None:
        """`counted`: Metrics.unwritten_outcome. `attempts`: Metrics.attempt_outcome, where an
        attempt whose completion is written here is counted once that write ends (a failed
        attempt's settlement was counted when it failed); `late`: Metrics.late_results, a
        result the job moved on from."""
        super().__init__(
            store,
            counted,
            ends=Ends(
                UnwrittenOutcome.DROPPED, UnwrittenOutcome.REFUSED, UnwrittenOutcome.MOVED_ON
            ),
            max_items=MAX_UNWRITTEN,
            max_bytes=MAX_UNWRITTEN_BYTES,
        )
        self._attempts = attempts
        self._late = late

    def _keeps(self, older: _Outcome, newer: _Outcome) -> bool:
        """A race's other attempt may end while one's outcome waits here: a newer result takes
        an older one's place (the job moves on from the older), but no settlement takes the
        place of a result (written first, it could release or give up a job whose result this
        process holds)."""
        return older.response is not None and newer.response is None

    def completion(self, job: Job, attempt: int, response: StoredResponse, ttl: float) -> None:
        completed = JobState.COMPLETED
        self._add(job.id, _Outcome(job, attempt, response, ttl, completed, None, None))

    def settlement(
        self, job: Job, attempt: int, state: JobState, status: int | None, error: str | None
    ) -> None:
        self._add(job.id, _Outcome(job, attempt, None, 0.0, state, status, error))

    def _size(self, outcome: _Outcome) -> int:
        response = outcome.response
        if response is None:
            return 0
        headers = sum(len(name) + len(value) for name, value in response.headers)
        return len(response.body or b"") + headers

    def _ended(self, item: _Outcome, outcome: UnwrittenOutcome) -> None:
        if item.response is None:
            return
        if self._attempts is not None:
            self._attempts[_ATTEMPT_ENDED[outcome]].inc()
        if self._late is not None and outcome is UnwrittenOutcome.MOVED_ON:
            self._late.inc()

    async def _settle(self, store: JobStore, outcome: _Outcome) -> UnwrittenOutcome:
        job, attempt = outcome.job, outcome.attempt
        if outcome.response is not None:
            won = await store.complete(job, attempt, outcome.response, ttl=outcome.ttl)
        else:
            won = await store.settle(
                job, attempt, outcome.state, status=outcome.status, error=outcome.error
            )
        if not won:
            if outcome.response is not None and await _completed_by(store, job, attempt):
                # Its first statement committed after all, its answer lost on the way back:
                # the compare-and-swap lost to itself.
                log.warning("job %s completed: its first write had committed", job.id)
                return UnwrittenOutcome.WRITTEN
            return UnwrittenOutcome.MOVED_ON
        log.warning(
            "job %s %s: its outcome was written after the proxy had answered 503",
            job.id,
            outcome.state.value,
        )
        return UnwrittenOutcome.WRITTEN


async def _completed_by(store: JobStore, job: Job, attempt: int) -> bool:
    """Whether `job` stands completed by `attempt` (read from the store)."""
    current = await store.get(job.owner, job.key)
    return current is not None and current.id == job.id and current.completed_by == attempt
