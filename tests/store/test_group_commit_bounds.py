"""Group commit's bounds (store/batching.py): a batch is never worse off than its requests alone.

`pool.store_batch: 1` is no batching at all; a batch is bounded by bytes as well as rows; and a
batch held up by one row (a lock another session holds) holds up neither its other rows beyond
what they would have waited alone, nor the requests behind it. The locks are real: a second
PostgreSQL session holds an uncommitted insert of a key, or a row lock on a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from idemproxy.core.types import Claimed, ClaimResult, Intent, StoredResponse
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from tests.support.stores import opened

FINE = StoredResponse(201, (("Content-Type", "text/plain"),), b"stored")


def _intent(key: str, owner: str = "alice") -> Intent:
    return Intent(owner, key, "fp", "POST", "/payments")


async def _claim(store: Store, key: str, job_id: str | None = None) -> ClaimResult:
    return await store.claim(
        _intent(key), job_id or str(uuid.uuid4()), "primary", ttl=3600.0, lease=30.0
    )


async def _claimed(store: Store, key: str) -> Claimed:
    claimed = await _claim(store, key)
    assert isinstance(claimed, Claimed)
    return claimed


@contextlib.asynccontextmanager
async def _key_held(dsn: str, key: str, owner: str = "alice") -> AsyncIterator[None]:
    """Another session's uncommitted insert of `key`: a claim of it waits on the unique index."""
    conn = await asyncpg.connect(dsn)
    transaction = conn.transaction()
    await transaction.start()
    await conn.execute(
        "INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, expires_at,"
        " lease_expires_at) VALUES ($1, $2, $3, 'fp', 'POST', '/payments',"
        " now() + interval '1 hour', now() + interval '30 seconds')",
        owner,
        key,
        uuid.uuid4(),
    )
    try:
        yield
    finally:
        await transaction.rollback()
        await conn.close()


async def _settle_loop() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


@pytest.mark.postgres
async def test_store_batch_1_sends_every_claim_alone_and_concurrently(pg_dsn: str) -> None:
    async with opened(create_store(pg_dsn, batch=1)) as store:
        async with _key_held(pg_dsn, "held"):
            held = asyncio.create_task(_claim(store, "held"))
            await _settle_loop()  # its statement waits for the other session
            others = await asyncio.wait_for(
                asyncio.gather(*(_claim(store, f"free-{i}") for i in range(9))), timeout=3.0
            )
            assert all(isinstance(result, Claimed) for result in others), others
            assert not held.done(), "the held key still waits, alone"
        assert isinstance(await held, Claimed), "the other session rolled back: it is new"


# --- bytes -------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def dsn(request: pytest.FixtureRequest) -> str:
    value: str = request.getfixturevalue(
        {"sqlite": "sqlite_dsn", "postgres": "pg_dsn"}[request.param]
    )
    return value


def _observe(store: Store) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []
    for batcher in store.group_commits():
        batcher.observer = lambda kind, rows: seen.append((kind, rows))
    return seen


async def test_large_completions_are_never_batched(dsn: str) -> None:
    """Each several MB (an upstream's large answer): each its own statement, as alone, never
    one statement of them all under one request's timeout."""
    async with opened(create_store(dsn)) as store:
        claims = [await _claimed(store, f"large-{i}") for i in range(6)]
        bodies = [bytes([i]) * (3 * 1024 * 1024) for i in range(6)]
        batches = _observe(store)
        won = await asyncio.gather(
            *(
                store.complete(c.job, c.attempt, StoredResponse(200, (), body), ttl=3600.0)
                for c, body in zip(claims, bodies, strict=True)
            )
        )
        assert won == [True] * 6
        assert batches == [("complete", 1)] * 6, "each alone"
        for claim, body in zip(claims, bodies, strict=True):
            job = await store.get("alice", claim.job.key)
            assert job is not None and job.response == StoredResponse(200, (), body)


async def test_a_batch_carries_at_most_a_mebibyte_of_bodies(dsn: str) -> None:
    async with opened(create_store(dsn)) as store:
        claims = [await _claimed(store, f"mid-{i}") for i in range(21)]
        body = b"m" * (60 * 1024)  # below the bound for a request alone: 17 fit in a batch
        batches = _observe(store)
        won = await asyncio.gather(
            *(
                store.complete(c.job, c.attempt, StoredResponse(200, (), body), ttl=3600.0)
                for c in claims
            )
        )
        assert won == [True] * 21
        rows = [count for _kind, count in batches]
        assert sum(rows) == 21 and rows[0] == 1, rows
        assert len(rows) >= 3 and max(rows) <= 17, rows
