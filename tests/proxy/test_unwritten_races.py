"""Outcomes the store could not take, when more than one attempt of a job ends meanwhile or the
first write committed after all (proxy/background/unwritten.py): every attempt is counted once
in `idemproxy_attempts_total`, no settlement takes a held result's place, and a write that lost
to its own earlier commit counts as written."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from idemproxy.core.types import AttemptState, Claimed, Intent, Job, JobState, StoredResponse
from idemproxy.observe.metrics import AttemptOutcome, Metrics
from idemproxy.proxy.background.unwritten import UnwrittenOutcomes
from idemproxy.store.base import Store
from tests.support.proxychecks import eventually, job_with_attempts

FIRST = StoredResponse(201, (("Content-Type", "text/plain"),), b"the primary's answer")
SECOND = StoredResponse(201, (("Content-Type", "text/plain"),), b"the hedge's answer")


async def _raced(store: Store, key: str) -> Job:
    """A job in flight with two attempts: the primary and a hedge."""
    intent = Intent("alice", key, "fp", "POST", "/payments")
    claimed = await store.claim(intent, str(uuid.uuid4()), "primary", ttl=3600.0, lease=30.0)
    assert isinstance(claimed, Claimed)
    assert await store.add_attempt(claimed.job, "hedge", lease=30.0) == 2
    return claimed.job


def _counts(metrics: Metrics) -> tuple[dict[str, float], dict[AttemptOutcome, float], float]:
    unwritten = {
        outcome: metrics.registry.get_sample_value(
            "idemproxy_unwritten_outcomes_total", {"outcome": outcome}
        )
        or 0.0
        for outcome in ("written", "moved_on", "dropped", "refused")
    }
    attempts = {outcome: metrics.attempt_outcome[outcome].value for outcome in AttemptOutcome}
    late = metrics.registry.get_sample_value("idemproxy_late_results_discarded_total") or 0.0
    return unwritten, attempts, late


async def _written(
    store: Store, metrics: Metrics, job: Job, *outcomes: tuple[int, StoredResponse | None]
) -> None:
    """Each (attempt, result) handed over at once, as attempts that ended while the store was
    away; a result of None is that attempt cut off (a settlement as unknown)."""
    unwritten = UnwrittenOutcomes(
        store, metrics.unwritten_outcome, metrics.attempt_outcome, metrics.late_results
    )
    try:
        for attempt, result in outcomes:
            if result is not None:
                unwritten.completion(job, attempt, result, ttl=3600.0)
            else:
                unwritten.settlement(job, attempt, JobState.UNKNOWN, None, "cut off")
        await eventually(lambda: len(unwritten) == 0)
    finally:
        await unwritten.close()


async def test_two_results_of_one_job_are_each_counted_once(store: Store) -> None:
    """Both racers answered while the store was away: the later result is written, the
    earlier one is a result the job moved on from (discarded), not lost from the counts."""
    job, metrics = await _raced(store, "two-results"), Metrics()
    await _written(store, metrics, job, (1, FIRST), (2, SECOND))
    unwritten, attempts, late = _counts(metrics)
    assert (unwritten["written"], unwritten["moved_on"]) == (1, 1)
    assert attempts[AttemptOutcome.SUCCEEDED] == 1
    assert attempts[AttemptOutcome.DISCARDED] == 1
    assert late == 1
    stored = await store.get("alice", "two-results")
    assert stored is not None and (stored.state, stored.completed_by) == (JobState.COMPLETED, 2)


async def test_a_settlement_never_takes_a_held_results_place(store: Store) -> None:
    """The primary's result waits for the store when the hedge is cut off: written first, the
    hedge's `unknown` would have given up a job whose result this process holds."""
    job, metrics = await _raced(store, "result-then-settlement"), Metrics()
    await _written(store, metrics, job, (1, FIRST), (2, None))
    stored = await job_with_attempts(store, "result-then-settlement", owner="alice")
    assert (stored.state, stored.completed_by) == (JobState.COMPLETED, 1)
    assert stored.attempts[0].state is AttemptState.SUCCEEDED
    unwritten, attempts, _ = _counts(metrics)
    assert (unwritten["written"], unwritten["moved_on"]) == (1, 1)
    assert attempts[AttemptOutcome.SUCCEEDED] == 1
    assert attempts[AttemptOutcome.DISCARDED] == 0


async def test_a_write_that_lost_to_its_own_earlier_commit_counts_as_written(
    store: Store,
) -> None:
    """The completion committed and its answer was lost (the client got 503): the late write
    loses its compare-and-swap to that very commit. The attempt succeeded."""
    job, metrics = await _raced(store, "lost-answer"), Metrics()
    assert await store.complete(job, 1, FIRST, ttl=3600.0)
    await _written(store, metrics, job, (1, FIRST))
    unwritten, attempts, late = _counts(metrics)
    assert (unwritten["written"], unwritten["moved_on"]) == (1, 0)
    assert attempts[AttemptOutcome.SUCCEEDED] == 1
    assert attempts[AttemptOutcome.DISCARDED] == 0
    assert late == 0


class _HeldFirstWrite:
    """The store, its first completion held until `go` is set (a write under way)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.started, self.go = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def complete(self, job: Job, attempt: int, response: Any, *, ttl: float) -> bool:
        if not self.started.is_set():
            self.started.set()
            await self.go.wait()
        return await self._store.complete(job, attempt, response, ttl=ttl)


async def test_a_result_that_comes_while_another_is_being_written_is_written_next(
    store: Store,
) -> None:
    """The hedge's result arrives while the primary's late write is under way: that write is
    counted by its own outcome, and the hedge's is written after it (it loses: discarded)."""
    job, metrics = await _raced(store, "during-a-write"), Metrics()
    held = _HeldFirstWrite(store)
    unwritten = UnwrittenOutcomes(
        held,
        metrics.unwritten_outcome,
        metrics.attempt_outcome,
        metrics.late_results,
    )
    try:
        unwritten.completion(job, 1, FIRST, ttl=3600.0)
        await asyncio.wait_for(held.started.wait(), 10)
        unwritten.completion(job, 2, SECOND, ttl=3600.0)
        held.go.set()
        await eventually(lambda: len(unwritten) == 0)
    finally:
        await unwritten.close()
    stored = await store.get("alice", "during-a-write")
    assert stored is not None and (stored.state, stored.completed_by) == (JobState.COMPLETED, 1)
    unwritten_counts, attempts, late = _counts(metrics)
    assert (unwritten_counts["written"], unwritten_counts["moved_on"]) == (1, 1)
    assert attempts[AttemptOutcome.SUCCEEDED] == 1
    assert attempts[AttemptOutcome.DISCARDED] == 1
    assert late == 1
