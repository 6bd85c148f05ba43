"""A follow-up write the store refuses for its data is final for that item, and never holds up
the others (proxy/background/followups.py).

The follow-up loop stopped each round at the first item that raised StoreUnavailable, rightly
while the store is away. But PostgreSQL refusing a statement's data (a value `jsonb` does not
take: SQLSTATE class 22) became StoreUnavailable too: the loop retried that item every second
for ever, and an outcome of another job that a genuine outage had left behind was never
written back (its retry got `409 outcome-unknown` once its lease ran out).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from idemproxy.core.types import Claimed, Intent, JobState, StoredResponse
from idemproxy.errors import StoreRefused
from idemproxy.observe.metrics import AttemptOutcome, Metrics
from idemproxy.proxy.background.unwritten import UnwrittenOutcomes
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from tests.support.proxychecks import eventually

# PostgreSQL's jsonb has no NUL in a string: `\u0000` is refused (SQLSTATE 22P05). The proxy
# never stores one (an upstream's NUL refuses its response); here it stands for any write
# whose data the store will not take, whatever the wait.
REFUSED = StoredResponse(200, (("X-Bad", "a\x00b"),), b"never stored")
FINE = StoredResponse(201, (("Content-Type", "text/plain"),), b"written back")


@pytest.fixture
async def pg_store(pg_dsn: str) -> AsyncIterator[Store]:
    store = create_store(pg_dsn)
    await store.open()
    await store.migrate()
    try:
        yield store
    finally:
        await store.close()


async def _claimed(store: Store, key: str) -> Claimed:
    intent = Intent("alice", key, "fp", "POST", "/payments")
    claimed = await store.claim(intent, str(uuid.uuid4()), "primary", ttl=3600.0, lease=30.0)
    assert isinstance(claimed, Claimed)
    return claimed


def _counted(metrics: Metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "idemproxy_unwritten_outcomes_total", {"outcome": outcome}
    )
    return value or 0.0


@pytest.mark.postgres
async def test_the_store_refusing_one_write_is_a_store_refused(pg_store: Store) -> None:
    store = pg_store
    claimed = await _claimed(store, "refused")
    with pytest.raises(StoreRefused):
        await store.complete(claimed.job, claimed.attempt, REFUSED, ttl=60.0)


@pytest.mark.postgres
async def test_a_refused_outcome_is_given_up_and_another_jobs_outcome_still_written(
    pg_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store = pg_store
    metrics = Metrics()
    refused = await _claimed(store, "refused")
    fine = await _claimed(store, "fine")
    unwritten = UnwrittenOutcomes(store, metrics.unwritten_outcome, metrics.attempt_outcome)
    # In this order: each round tries the refused one first.
    unwritten.completion(refused.job, refused.attempt, REFUSED, ttl=60.0)
    unwritten.completion(fine.job, fine.attempt, FINE, ttl=60.0)
    try:
        await eventually(lambda: len(unwritten) == 0)
    finally:
        await unwritten.close()
    written = await store.get("alice", "fine")
    assert written is not None and written.state is JobState.COMPLETED
    assert written.response == FINE
    left = await store.get("alice", "refused")
    assert left is not None and left.state is JobState.IN_FLIGHT  # to its lease, then unknown
    assert (_counted(metrics, "refused"), _counted(metrics, "written")) == (1, 1)
    # The refused one's job goes to its lease, then unknown: its attempt is counted so.
    attempts = {o: metrics.attempt_outcome[o].value for o in AttemptOutcome}
    assert attempts == {
        AttemptOutcome.SUCCEEDED: 1,
        AttemptOutcome.UNKNOWN: 1,
        AttemptOutcome.FAILED: 0,
        AttemptOutcome.DISCARDED: 0,
    }
    assert f"the follow-up of job {refused.job.id} was refused by the store" in caplog.text


async def test_a_text_no_store_can_hold_is_refused_on_both_stores(store: Store) -> None:
    """A lone surrogate (a byte that is not UTF-8, decoded with surrogateescape) in a text
    column: asyncpg and sqlite3 cannot encode it. Refused, never a store outage."""
    claimed = await _claimed(store, "text")
    with pytest.raises(StoreRefused):
        await store.settle(claimed.job, claimed.attempt, JobState.RELEASED, error="\udce9")
