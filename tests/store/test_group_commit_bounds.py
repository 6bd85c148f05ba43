"""Group commit's bounds (store/batching.py): a batch is never worse off than its requests alone.

`pool.store_batch: 1` is no batching at all; a batch is bounded by bytes as well as rows; and a
batch held up by one row (a lock another session holds) holds up neither its other rows beyond
what they would have waited alone, nor the requests behind it. The locks are real: a second
PostgreSQL session holds an uncommitted insert of a key, or a row lock on a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import asyncpg
import pytest

from idemproxy.core.types import Claimed, ClaimResult, Existing, Intent, StoredResponse
from idemproxy.errors import StoreUnavailable
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from tests.support.slowreplies import SlowReplies
from tests.support.stores import opened

T = TypeVar("T")
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
        batcher.observer = functools.partial(_note, seen, batcher.kind)
    return seen


def _note(seen: list[tuple[str, int]], kind: str, rows: int) -> None:
    seen.append((kind, rows))


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


# --- a batch held up by one row ----------------------------------------------------------------

# The store's per-request timeout in these tests (`pool.store_timeout`), seconds.
DEADLINE = 2.0


@contextlib.asynccontextmanager
async def _job_locked(dsn: str, job_id: str) -> AsyncIterator[None]:
    """Another session holds a row lock on the job (`SELECT … FOR UPDATE`)."""
    conn = await asyncpg.connect(dsn)
    transaction = conn.transaction()
    await transaction.start()
    await conn.execute("SELECT 1 FROM idemproxy.jobs WHERE id = $1 FOR UPDATE", uuid.UUID(job_id))
    try:
        yield
    finally:
        await transaction.rollback()
        await conn.close()


async def _timed(work: Awaitable[T]) -> tuple[T | BaseException, float]:
    """`work`'s result (or error) and the seconds it took."""
    started = time.monotonic()
    try:
        result: T | BaseException = await work
    except Exception as exc:
        result = exc
    return result, time.monotonic() - started


@pytest.mark.postgres
async def test_a_claim_held_up_in_a_batch_fails_only_itself(pg_dsn: str) -> None:
    """19 claims in one batch, one of a key another session is inserting: the other 18 are
    claimed within their own deadline; the held one fails as it would have alone."""
    keys = [f"claim-{i}" for i in range(19)]
    keys[10] = "held"
    async with (
        opened(create_store(pg_dsn, command_timeout=DEADLINE)) as store,
        _key_held(pg_dsn, "held"),
    ):
        batches = _observe(store)
        lead = asyncio.create_task(_claim(store, "lead"))  # alone at once; the 19 behind it
        timed = list(await asyncio.gather(*(_timed(_claim(store, key)) for key in keys)))
        assert isinstance(await lead, Claimed)
    assert ("claim", 19) in batches, "they were batched"
    held, held_took = timed.pop(10)
    assert isinstance(held, StoreUnavailable), held
    assert held_took >= DEADLINE * 0.9, "it waited as long as it would have alone"
    for result, took in timed:
        assert isinstance(result, Claimed), result
        assert took < DEADLINE, took


@pytest.mark.postgres
async def test_a_completion_held_up_in_a_batch_fails_only_itself(pg_dsn: str) -> None:
    async with opened(create_store(pg_dsn, command_timeout=DEADLINE)) as store:
        claims = [await _claimed(store, f"job-{i}") for i in range(10)]
        batches = _observe(store)
        async with _job_locked(pg_dsn, claims[5].job.id):
            timed = await asyncio.gather(
                *(_timed(store.complete(c.job, c.attempt, FINE, ttl=3600.0)) for c in claims)
            )
        assert ("complete", 9) in batches, "they were batched"
        locked, _took = timed.pop(5)
        assert isinstance(locked, StoreUnavailable), locked
        for result, took in timed:
            assert result is True and took < DEADLINE, (result, took)
        for i, claim in enumerate(claims):
            job = await store.get("alice", claim.job.key)
            assert job is not None and job.response == (None if i == 5 else FINE)


@pytest.mark.postgres
async def test_a_held_up_statement_does_not_hold_up_the_requests_behind_it(pg_dsn: str) -> None:
    async with (
        opened(create_store(pg_dsn, command_timeout=DEADLINE)) as store,
        _key_held(pg_dsn, "held"),
    ):
        held = asyncio.create_task(_claim(store, "held"))
        await _settle_loop()  # its statement is out, waiting for the other session
        behind = await asyncio.wait_for(
            asyncio.gather(*(_claim(store, f"behind-{i}") for i in range(10))),
            timeout=DEADLINE * 0.75,
        )
        assert all(isinstance(result, Claimed) for result in behind), behind
        assert not held.done()
        with pytest.raises(StoreUnavailable):
            await held


@pytest.mark.postgres
async def test_a_claim_that_finds_its_own_job_is_claimed(pg_dsn: str) -> None:
    """What a batched claim retried alone finds when its batch committed before its answer was
    lost (a timeout): its own job, by its id. It is its claim, not a duplicate to hold on."""
    async with opened(create_store(pg_dsn)) as store:
        job_id = str(uuid.uuid4())
        first = await _claim(store, "mine", job_id)
        again = await _claim(store, "mine", job_id)
        assert isinstance(first, Claimed) and isinstance(again, Claimed), again
        assert again.job.id == job_id and again.attempt == 1
        other = await _claim(store, "mine")
        assert isinstance(other, Existing), "another request's claim of the key is a duplicate"


async def test_a_completion_written_already_loses_and_the_job_holds_it(dsn: str) -> None:
    """What a batched completion retried alone finds when its batch committed before its answer
    was lost: its compare-and-swap loses (the caller re-reads and replays), the job holds its
    response, and its attempt stays the winner."""
    async with opened(create_store(dsn)) as store:
        claim = await _claimed(store, "written")
        assert await store.complete(claim.job, claim.attempt, FINE, ttl=3600.0)
        assert not await store.complete(claim.job, claim.attempt, FINE, ttl=3600.0)
        job = await store.get("alice", "written")
        assert job is not None and job.response == FINE and job.state.value == "completed"
        full = await store.get_by_id(claim.job.id)
        assert full is not None
        assert [a.state.value for a in full.attempts] == ["succeeded"]


@pytest.mark.postgres
async def test_a_batch_that_committed_but_timed_out_is_answered_from_what_it_wrote(
    pg_dsn: str,
) -> None:
    """The batch's statement commits and its answer comes after the batch's timeout (half the
    store timeout): each row retried alone finds what the batch wrote. A claim finds its own job
    and is claimed (never a duplicate that would hold on itself); a completion loses its
    compare-and-swap and the job holds its response."""
    relay = SlowReplies(pg_dsn)
    async with (
        relay as slow_dsn,
        # One connection: every statement runs on the one that has prepared them all.
        opened(create_store(slow_dsn, command_timeout=DEADLINE, max_connections=1)) as store,
    ):
        batches = await _prepare_batches(store, relay)

        lead = asyncio.create_task(_claim(store, "lead"))
        ids = [str(uuid.uuid4()) for _ in range(3)]
        results = await asyncio.gather(*(_claim(store, f"ambiguous-{i}", ids[i]) for i in range(3)))
        lead_claim = await lead
        assert isinstance(lead_claim, Claimed)
        assert ("claim", 3) in batches, "the three went out in one batch"
        for job_id, result in zip(ids, results, strict=True):
            assert isinstance(result, Claimed), result
            assert result.job.id == job_id and result.attempt == 1
        claims = [result for result in results if isinstance(result, Claimed)]
        keys = [claim.job.key for claim in claims]
        assert await _xmins(pg_dsn, keys) == 1, "the batch committed them, in one transaction"

        batches = await _prepare_batches(store, relay)  # on the connections in use now
        lead_done = asyncio.create_task(
            store.complete(lead_claim.job, lead_claim.attempt, FINE, ttl=3600.0)
        )
        won = await asyncio.gather(
            *(store.complete(c.job, c.attempt, FINE, ttl=3600.0) for c in claims)
        )
        assert await lead_done
        assert ("complete", 3) in batches, "the three went out in one batch"
        assert await _xmins(pg_dsn, keys) == 1, "the batch completed them"
        assert won == [False] * 3, "each lost its compare-and-swap to its own batch"
        for claim in claims:
            job = await store.get("alice", claim.job.key)
            assert job is not None and job.state.value == "completed" and job.response == FINE
            assert job.id == claim.job.id


async def _prepare_batches(store: Store, relay: SlowReplies) -> list[tuple[str, int]]:
    """A lead and a batch behind it, twice over: the kept connection has prepared each
    statement, so that a batch's statement is sent (and runs) in one go. Then each batch of
    several sent is answered late (`_slow_batch_answers`), and listed in the list returned."""
    for batcher in store.group_commits():
        batcher.observer = None
    for round_ in (uuid.uuid4().hex, uuid.uuid4().hex):
        lead = asyncio.create_task(_claimed(store, f"warm-{round_}-0"))
        rest = await asyncio.gather(*(_claimed(store, f"warm-{round_}-{i}") for i in (1, 2, 3)))
        claims = [await lead, *rest]
        await asyncio.gather(*(store.complete(c.job, c.attempt, FINE, ttl=3600.0) for c in claims))
    batches: list[tuple[str, int]] = []
    for batcher in store.group_commits():
        batcher.observer = functools.partial(_slow_batch_answers, relay, batches, batcher.kind)
    return batches


def _slow_batch_answers(
    relay: SlowReplies, seen: list[tuple[str, int]], kind: str, rows: int
) -> None:
    """As a batch of several goes out: its answer comes after its timeout; the rows it retries
    alone, a moment later, are answered at once."""
    seen.append((kind, rows))
    if rows > 1:
        relay.delay_next_run(DEADLINE * 0.75, lasting=DEADLINE * 0.25)


async def _xmins(dsn: str, keys: list[str]) -> int:
    """How many transactions wrote the jobs under `keys` last."""
    conn = await asyncpg.connect(dsn)
    try:
        value = await conn.fetchval(
            "SELECT count(DISTINCT xmin::text) FROM idemproxy.jobs WHERE key = ANY($1::text[])",
            keys,
        )
    finally:
        await conn.close()
    return int(value)
