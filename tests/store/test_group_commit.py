"""Group commit (store/batching.py): concurrent claims and completions share one statement and
one durable commit, and each caller still gets exactly its own row's result or error.

Commits are counted on PostgreSQL by the rows' `xmin` (the id of the transaction that wrote
them: one per commit), on both stores by the batch-size hook the metrics use.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from idemproxy.core.types import Claimed, ClaimResult, Existing, Intent, StoredResponse
from idemproxy.errors import StoreRefused
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store, sqlite_path
from tests.support.stores import opened, record_batches

CONCURRENT = 32
FINE = StoredResponse(201, (("Content-Type", "text/plain"),), b"stored")
# PostgreSQL's jsonb takes no NUL in a string (SQLSTATE 22P05): a completion it refuses.
REFUSED = StoredResponse(200, (("X-Bad", "a\x00b"),), b"never stored")
# A lone surrogate (a byte that is not UTF-8, decoded with surrogateescape): no store can hold it.
UNSTORABLE_KEY = "bad-\udce9"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def dsn(request: pytest.FixtureRequest) -> str:
    value: str = request.getfixturevalue(
        {"sqlite": "sqlite_dsn", "postgres": "pg_dsn"}[request.param]
    )
    return value


@pytest.fixture
async def store(dsn: str) -> AsyncIterator[Store]:
    async with opened(create_store(dsn)) as opened_store:
        yield opened_store


@pytest.fixture
def batches(store: Store) -> Iterator[list[tuple[str, int]]]:
    """Every batched statement the store sends: (kind, rows)."""
    yield record_batches(store)


def _intent(key: str, fingerprint: str = "fp", owner: str = "alice") -> Intent:
    return Intent(owner, key, fingerprint, "POST", "/payments")


async def _claim(store: Store, intent: Intent, *, lease: float = 30.0) -> ClaimResult:
    return await store.claim(intent, str(uuid.uuid4()), "primary", ttl=3600.0, lease=lease)


async def _claimed(store: Store, key: str) -> Claimed:
    claimed = await _claim(store, _intent(key))
    assert isinstance(claimed, Claimed)
    return claimed


async def _xmins(dsn: str, keys: list[str]) -> int:
    """How many transactions wrote the jobs under `keys` last (PostgreSQL)."""
    conn = await asyncpg.connect(dsn)
    try:
        value = await conn.fetchval(
            "SELECT count(DISTINCT xmin::text) FROM idemproxy.jobs WHERE key = ANY($1::text[])",
            keys,
        )
    finally:
        await conn.close()
    return int(value)


async def test_concurrent_claims_and_completions_share_one_statement(
    store: Store, dsn: str, batches: list[tuple[str, int]]
) -> None:
    keys = [f"new-{i}" for i in range(CONCURRENT)]
    results = await asyncio.gather(*(_claim(store, _intent(key)) for key in keys))
    claims = [c for c in results if isinstance(c, Claimed)]
    assert len(claims) == CONCURRENT
    assert [c.job.key for c in claims] == keys, "each caller got its own row"
    claim_rows = [rows for kind, rows in batches if kind == "claim"]
    assert sum(claim_rows) == CONCURRENT
    assert len(claim_rows) <= 2 and max(claim_rows) >= CONCURRENT - 1, claim_rows
    if not dsn.startswith("sqlite"):
        assert await _xmins(dsn, keys) <= 2, "the claims were committed together"

    won = await asyncio.gather(
        *(store.complete(c.job, c.attempt, FINE, ttl=3600.0) for c in claims)
    )
    assert won == [True] * CONCURRENT
    complete_rows = [rows for kind, rows in batches if kind == "complete"]
    assert sum(complete_rows) == CONCURRENT and len(complete_rows) <= 2, complete_rows
    if not dsn.startswith("sqlite"):
        assert await _xmins(dsn, keys) <= 2, "the completions were committed together"
    for claim in claims:
        job = await store.get("alice", claim.job.key)
        assert job is not None and job.response == FINE and job.id == claim.job.id


async def test_a_lone_claim_goes_out_at_once_in_a_statement_of_its_own(
    store: Store, batches: list[tuple[str, int]]
) -> None:
    for key in ("one", "two", "three"):
        await _claimed(store, key)
    assert batches == [("claim", 1)] * 3


async def test_mixed_outcomes_in_one_batch_each_caller_gets_its_own(
    store: Store, batches: list[tuple[str, int]]
) -> None:
    done = await _claimed(store, "done")
    assert await store.complete(done.job, done.attempt, FINE, ttl=3600.0)
    mismatch = await _claimed(store, "mismatch")
    orphan = await _claim(store, _intent("orphan"), lease=0.0)  # its lease runs out at once
    assert isinstance(orphan, Claimed)
    batches.clear()

    # The first goes out alone at once; the five behind it in one statement.
    _lead, new, same, other, expired, new2 = await asyncio.gather(
        _claim(store, _intent("lead")),
        _claim(store, _intent("fresh")),
        _claim(store, _intent("done")),
        _claim(store, _intent("mismatch", fingerprint="another body")),
        _claim(store, _intent("orphan")),
        _claim(store, _intent("fresh-2")),
    )
    assert batches == [("claim", 1), ("claim", 5)], "all five in one statement"
    assert isinstance(new, Claimed) and new.job.key == "fresh" and new.attempt == 1
    assert isinstance(new2, Claimed) and new2.job.key == "fresh-2"
    assert new.job.id != new2.job.id
    assert isinstance(same, Existing) and same.job.id == done.job.id
    assert same.job.response == FINE
    assert isinstance(other, Existing) and other.job.id == mismatch.job.id
    assert other.job.fingerprint == "fp", "the stored fingerprint, for the caller to compare"
    assert isinstance(expired, Existing) and expired.job.id == orphan.job.id
    assert expired.job.lease_expired, "the caller sees a job to take over"
    assert await store.take_over(expired.job)


async def test_the_same_key_twice_goes_out_in_two_batches(
    store: Store, batches: list[tuple[str, int]]
) -> None:
    first, second = await asyncio.gather(
        _claim(store, _intent("twice")), _claim(store, _intent("twice"))
    )
    assert isinstance(first, Claimed)
    assert isinstance(second, Existing) and second.job.id == first.job.id
    assert batches == [("claim", 1), ("claim", 1)]


async def test_one_refused_claim_fails_only_its_caller(
    store: Store, batches: list[tuple[str, int]]
) -> None:
    keys = [f"good-{i}" for i in range(4)]
    lead = _claim(store, _intent("lead"))  # alone at once; the five behind it together
    _lead, *results = await asyncio.gather(
        lead,
        *(_claim(store, _intent(key)) for key in [*keys[:2], UNSTORABLE_KEY, *keys[2:]]),
        return_exceptions=True,
    )
    assert isinstance(results[2], StoreRefused), results[2]
    good = [r for i, r in enumerate(results) if i != 2]
    assert all(isinstance(r, Claimed) for r in good), good
    assert [r.job.key for r in good if isinstance(r, Claimed)] == keys
    assert batches == [("claim", 1), ("claim", 5)], "they were batched"
    for key in keys:
        assert await store.get("alice", key) is not None


@pytest.mark.postgres
async def test_one_refused_completion_fails_only_its_caller(pg_dsn: str) -> None:
    async with opened(create_store(pg_dsn)) as store:
        claims = [await _claimed(store, f"job-{i}") for i in range(4)]
        responses = [FINE, REFUSED, FINE, FINE]
        sizes: list[int] = []
        store.group_commits()[1].observer = sizes.append
        results = await asyncio.gather(
            *(
                store.complete(c.job, c.attempt, response, ttl=3600.0)
                for c, response in zip(claims, responses, strict=True)
            ),
            return_exceptions=True,
        )
        assert isinstance(results[1], StoreRefused), results
        assert [results[0], results[2], results[3]] == [True, True, True]
        assert sizes == [1, 3], "the first alone, the refused one in a batch behind it"
        for claim, response in zip(claims, responses, strict=True):
            job = await store.get("alice", claim.job.key)
            assert job is not None
            assert job.response == (FINE if response is FINE else None)


async def test_a_losing_completion_in_a_batch_is_a_loss_for_its_caller_only(
    store: Store,
) -> None:
    claims = [await _claimed(store, f"race-{i}") for i in range(3)]
    taken = await _claim(store, _intent("taken"), lease=0.0)
    assert isinstance(taken, Claimed)
    stale = await store.get("alice", "taken")
    assert stale is not None and await store.take_over(stale)
    results = await asyncio.gather(
        *(store.complete(c.job, c.attempt, FINE, ttl=3600.0) for c in [*claims, taken])
    )
    assert results == [True, True, True, False]
    late = await store.late_response(taken.job, taken.attempt)
    assert late == FINE, "the late response is kept for the operator, as alone"


# --- cancellation ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _writes_blocked(dsn: str) -> AsyncIterator[None]:
    """Another session holds the store's write lock: the store's next write waits for it."""
    if not dsn.startswith("sqlite"):
        conn = await asyncpg.connect(dsn)
        transaction = conn.transaction()
        await transaction.start()
        await conn.execute("LOCK TABLE idemproxy.jobs IN EXCLUSIVE MODE")
        try:
            yield
        finally:
            await transaction.rollback()
            await conn.close()
        return
    other = sqlite3.connect(sqlite_path(dsn), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()


async def _settle_loop() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


async def test_a_caller_cancelled_while_queued_never_reaches_the_store(
    store: Store, dsn: str, batches: list[tuple[str, int]]
) -> None:
    flights = store.group_commits()[0].in_flight
    async with _writes_blocked(dsn):
        # As many statements out as may be in flight at once, each waiting for the lock (each
        # goes out alongside the ones before it once they have waited `stall`).
        first = []
        for i in range(flights):
            first.append(asyncio.create_task(_claim(store, _intent(f"in-flight-{i}"))))
            await _settle_loop()
        queued = asyncio.create_task(_claim(store, _intent("queued")))
        kept = asyncio.create_task(_claim(store, _intent("kept")))
        await _settle_loop()
        queued.cancel()
        await _settle_loop()
    assert all(isinstance(claim, Claimed) for claim in await asyncio.gather(*first))
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert isinstance(await kept, Claimed)
    assert await store.get("alice", "queued") is None, "a cancelled queued claim is never sent"
    assert batches == [("claim", 1)] * (flights + 1)


async def test_a_caller_cancelled_in_flight_leaves_the_batch_to_the_others(
    store: Store, batches: list[tuple[str, int]]
) -> None:
    lead = asyncio.create_task(_claim(store, _intent("lead")))
    tasks = [asyncio.create_task(_claim(store, _intent(f"batch-{i}"))) for i in range(3)]
    (claims, _completions) = store.group_commits()

    def cancel_one_once_sent(rows: int) -> None:
        batches.append((claims.kind, rows))
        if rows == 3:  # called as the batch goes out: its statement is in flight now
            tasks[1].cancel()

    claims.observer = cancel_one_once_sent
    results = await asyncio.gather(lead, *tasks, return_exceptions=True)
    assert isinstance(results[2], asyncio.CancelledError)
    assert [type(r) for r in (results[0], results[1], results[3])] == [Claimed] * 3
    assert batches == [("claim", 1), ("claim", 3)], "the lead alone, the others behind it"
    # The statement ran to its end: the cancelled caller's claim is committed, a job nobody
    # runs, which the proxy releases as a claim it never forwarded (proxy/background/unsent.py).
    job = await store.get("alice", "batch-1")
    assert job is not None and job.state.value == "in_flight"
