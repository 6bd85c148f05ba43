"""One PostgreSQL store call (SPEC §11, §13): timed, its driver errors translated, and retried
once on a fresh connection only when asyncpg refused a pooled session the server had ended."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idemproxy.core.types import Claimed, Intent, StoredResponse
from idemproxy.errors import StoreUnavailable
from idemproxy.identity.intent import new_job_id
from idemproxy.observe.metrics import Metrics, watch_store
from idemproxy.store.layers import StoreStack
from idemproxy.store.postgres.store import Connections, PostgresStore, _live_connection_next

pytestmark = pytest.mark.postgres


@pytest.fixture
async def pg_store(pg_dsn: str) -> AsyncIterator[tuple[PostgresStore, list[tuple[str, bool]]]]:
    store = PostgresStore(pg_dsn, connections=Connections(1, 2), listen=False)
    seen: list[tuple[str, bool]] = []
    store.observer = lambda operation, seconds, failed: seen.append((operation, failed))
    await store.open()
    yield store, seen
    await store.close()


def _failing(*errors: BaseException) -> Any:
    remaining = list(errors)

    async def call(conn: Any) -> int:
        if remaining:
            raise remaining.pop(0)
        return int(await conn.fetchval("SELECT 7"))

    return call


async def test_a_call_is_timed_once(pg_store: tuple[PostgresStore, list[tuple[str, bool]]]) -> None:
    store, seen = pg_store
    assert await store._run("probe", _failing()) == 7
    assert seen == [("probe", False)]


async def test_an_ended_pooled_session_is_retried_once_on_a_fresh_connection(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
) -> None:
    store, seen = pg_store
    assert await store._run("probe", _failing(asyncpg.InternalClientError("gone"))) == 7
    assert seen == [("probe", False), ("probe", False)]  # no error of the store's


async def test_a_second_refusal_is_store_unavailable(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
) -> None:
    store, seen = pg_store
    refusals = (asyncpg.InternalClientError("gone"), asyncpg.InternalClientError("again"))
    with pytest.raises(StoreUnavailable):
        await store._run("probe", _failing(*refusals))
    assert seen == [("probe", False), ("probe", True)]


LOST = [
    asyncpg.ConnectionDoesNotExistError("closed in the middle of operation"),
    asyncpg.AdminShutdownError("terminating connection due to administrator command"),
    ConnectionResetError(),
]


@pytest.mark.parametrize("error", LOST, ids=["closed", "terminated", "reset"])
async def test_a_read_that_lost_its_connection_is_asked_again_once(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
    error: BaseException,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A held duplicate's re-read of its job on a session the server ended as it was sent got
    503 on a healthy store."""
    store, seen = pg_store
    assert await store._run("get_job", _failing(error)) == 7
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert seen == [("get_job", False), ("get_job", False)]  # not counted, not warned
    with pytest.raises(StoreUnavailable):
        await store._run("get_job", _failing(error, error))


@pytest.mark.parametrize("error", LOST, ids=["closed", "terminated", "reset"])
async def test_a_write_that_lost_its_connection_is_never_sent_again(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]], error: BaseException
) -> None:
    """It may have committed: its outcome is the caller's to find out (SPEC §3.4)."""
    store, seen = pg_store
    with pytest.raises(StoreUnavailable):
        await store._run("complete", _failing(error))
    assert seen == [("complete", True)]


async def test_a_held_duplicate_s_read_survives_its_session_ended_by_the_server(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]], pg_dsn: str
) -> None:
    store, _ = pg_store
    await store.get("owner", "no-such-key")
    ended = await _backend_pid(store)
    admin = await asyncpg.connect(pg_dsn)
    try:
        for _ in range(5):  # ended as the read goes out, before asyncpg could notice
            killing = asyncio.create_task(admin.fetchval("SELECT pg_terminate_backend($1)", ended))
            assert await store.get("owner", "no-such-key") is None
            await killing
            await asyncio.sleep(0.2)  # a session ended after the read: seen before the next
            ended = await _backend_pid(store)
    finally:
        await admin.close()


@pytest.mark.parametrize(
    "error",
    [asyncpg.PostgresError("boom"), ConnectionResetError(), TimeoutError()],
    ids=["server", "socket", "timeout"],
)
async def test_other_driver_errors_are_not_retried(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]], error: BaseException
) -> None:
    store, seen = pg_store
    with pytest.raises(StoreUnavailable) as caught:
        await store._run("probe", _failing(error))
    assert caught.value.__cause__ is error
    assert seen == [("probe", True)]


async def test_other_errors_pass_through_and_the_connection_goes_back(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
) -> None:
    store, seen = pg_store
    for _ in range(3):  # more than the pool holds: each call gave its connection back
        with pytest.raises(KeyError):
            await store._run("probe", _failing(KeyError("bug")))
    assert seen == [("probe", False)] * 3
    assert await store._run("probe", _failing()) == 7


async def test_a_claim_and_a_completion_are_each_timed_once_as_a_whole(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
) -> None:
    """SPEC §13: their statements, run for the group commit, are timed by them, not again."""
    store, seen = pg_store
    intent = Intent("alice", "k", "fp", "POST", "/")
    claimed = await store.claim(intent, new_job_id(), "u", ttl=60, lease=30)
    assert isinstance(claimed, Claimed)
    response = StoredResponse(201, (("X-A", "1"),), b"{}")
    assert await store.complete(claimed.job, claimed.attempt, response, ttl=60)
    assert seen == [("claim", False), ("complete", False)]


async def test_a_new_keys_completion_is_its_sole_statement_alone(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]], pg_dsn: str
) -> None:
    """A job of one attempt that wins is completed by `complete_sole`, never `complete`."""
    store, seen = pg_store
    store._sql = {**store._sql, "complete": "SELECT 1 / 0"}  # fails if it is sent
    intent = Intent("alice", "k", "fp", "POST", "/")
    claimed = await store.claim(intent, new_job_id(), "u", ttl=60, lease=30)
    assert isinstance(claimed, Claimed)
    assert await store.complete(claimed.job, 1, StoredResponse(201, (), b"{}"), ttl=60)
    assert seen == [("claim", False), ("complete", False)]
    assert await _attempts(pg_dsn, claimed.job.id) == [("succeeded", False)]


async def test_a_completion_of_a_job_hedged_since_it_was_read_is_decided_by_complete(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]], pg_dsn: str
) -> None:
    """The sole statement loses to the hedge it did not know of (the caller's job says one
    attempt); `complete` then wins and ends the hedge's lease with the job."""
    store, _ = pg_store
    intent = Intent("alice", "k", "fp", "POST", "/")
    claimed = await store.claim(intent, new_job_id(), "u", ttl=60, lease=30)
    assert isinstance(claimed, Claimed)
    assert await store.add_attempt(claimed.job, "hedge", lease=30) == 2
    assert claimed.job.attempt_count == 1
    assert await store.complete(claimed.job, 1, StoredResponse(201, (), b"{}"), ttl=60)
    assert await _attempts(pg_dsn, claimed.job.id) == [("succeeded", False), ("started", False)]
    job = await store.get("alice", "k")
    assert job is not None and job.completed_by == 1


async def _attempts(dsn: str, job_id: str) -> list[tuple[str, bool]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT state, lease_expires_at IS NOT NULL AS leased FROM idemproxy.attempts"
            " WHERE job_id = $1 ORDER BY number",
            uuid.UUID(job_id),
        )
    finally:
        await conn.close()
    return [(row["state"], row["leased"]) for row in rows]


async def test_a_claim_the_store_refuses_is_timed_as_failed(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
) -> None:
    store, seen = pg_store
    await _refused_claim(store, "k")
    assert seen == [("claim", True)]


async def _refused_claim(store: PostgresStore, key: str) -> None:
    """A claim of `key` whose statement the store refuses: StoreUnavailable."""

    async def refused(_request: object) -> Claimed:
        raise StoreUnavailable("refused")

    store.claims.alone = refused
    with pytest.raises(StoreUnavailable):
        await store.claim(
            Intent("alice", key, "fp", "POST", "/"), new_job_id(), "u", ttl=60, lease=30
        )


async def test_the_metrics_time_claims_and_completions_in_place_and_count_a_refusal(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
) -> None:
    """SPEC §13 through the process's own wiring (`watch_store`): a claim and a completion
    that succeed go straight to their `store_seconds` series; one that fails is timed and
    counted as an error, through the observer as every other call."""
    store, _ = pg_store
    metrics = Metrics()
    watch_store(metrics, StoreStack.of(store))
    intent = Intent("alice", "k", "fp", "POST", "/")
    claimed = await store.claim(intent, new_job_id(), "u", ttl=60, lease=30)
    assert isinstance(claimed, Claimed)
    assert await store.complete(claimed.job, 1, StoredResponse(201, (), b"{}"), ttl=60)
    await _refused_claim(store, "k2")
    samples = {
        (sample.name, tuple(sample.labels.items())): sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
    }
    assert samples[("idemproxy_store_seconds_count", (("operation", "claim"),))] == 2
    assert samples[("idemproxy_store_seconds_count", (("operation", "complete"),))] == 1
    assert samples[("idemproxy_store_errors_total", (("operation", "claim"),))] == 1
    assert samples[("idemproxy_store_errors_total", (("operation", "complete"),))] == 0


async def test_a_closed_store_is_unavailable_and_not_timed(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
) -> None:
    store, seen = pg_store
    await store.close()
    store._pool = None
    with pytest.raises(StoreUnavailable):
        await store.ping()
    assert seen == []


@contextlib.asynccontextmanager
async def _its_one_connection_held(
    pg_dsn: str, command_timeout: float
) -> AsyncIterator[tuple[PostgresStore, asyncio.Event, asyncio.Task[None]]]:
    """A store of one connection, which a task holds until the event is set."""
    store = PostgresStore(
        pg_dsn, connections=Connections(1, 1), command_timeout=command_timeout, listen=False
    )
    await store.open()
    try:
        held, done = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with store._connection("hold"):
                held.set()
                await done.wait()

        holder = asyncio.create_task(hold())
        await held.wait()
        yield store, done, holder
    finally:
        await store.close()


async def test_waiting_for_a_connection_is_bounded_by_the_command_timeout(pg_dsn: str) -> None:
    async with _its_one_connection_held(pg_dsn, 0.3) as (store, done, holder):
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as caught:
            await store.ping()
        assert isinstance(caught.value.__cause__, TimeoutError)
        assert time.monotonic() - started < 2
        done.set()
        await holder
        await store.ping()  # the connection came back and is handed out at once
        await store.ping()


async def test_an_idle_live_connection_is_seen_so_its_acquire_arms_no_deadline(
    pg_dsn: str,
) -> None:
    """Reads asyncpg's internals: if they change, this fails rather than every call silently
    paying for a deadline again."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    try:
        assert _live_connection_next(pool)  # the min_size connection, idle in the queue
        conn = await pool.acquire()
        assert not _live_connection_next(pool)  # the next holder has no connection yet
        await pool.release(conn)
        assert _live_connection_next(pool)
    finally:
        await pool.close()
    assert not _live_connection_next(object())  # anything else: the bounded acquire


async def _backend_pid(store: PostgresStore) -> int:
    return int(await store._run("pid", lambda c: c.fetchval("SELECT pg_backend_pid()")))


async def test_a_connection_is_kept_between_statements(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
) -> None:
    store, _ = pg_store
    first = await _backend_pid(store)
    for _ in range(5):
        assert await _backend_pid(store) == first  # not given back to asyncpg's pool


async def test_a_kept_connection_goes_to_a_caller_waiting_in_the_pool(pg_dsn: str) -> None:
    async with _its_one_connection_held(pg_dsn, 2.0) as (store, done, holder):
        waiter = asyncio.create_task(store.ping())  # waits in the pool's acquire
        await asyncio.sleep(0.05)
        started = time.monotonic()
        done.set()
        await holder
        await waiter  # handed the connection when the holder finished, not at its deadline
        assert time.monotonic() - started < 1.0


async def test_a_kept_connection_the_server_ended_is_not_reused(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]], pg_dsn: str
) -> None:
    store, seen = pg_store
    ended = await _backend_pid(store)
    admin = await asyncpg.connect(pg_dsn)
    try:
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", ended)
    finally:
        await admin.close()
    await asyncio.sleep(0.2)  # the kept connection reads the server's goodbye
    assert await _backend_pid(store) != ended
    assert ("pid", True) not in seen  # no statement was sent on the dead connection


async def test_closing_gives_the_kept_connections_back_at_once(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresStore(pg_dsn, connections=Connections(1, 2), command_timeout=3.0, listen=False)
    await store.open()
    await asyncio.gather(store.ping(), store.ping())  # two connections, both kept
    started = time.monotonic()
    await store.close()
    assert time.monotonic() - started < 1.0  # the pool's close did not wait for them
    assert "did not close in time" not in caplog.text
    with pytest.raises(StoreUnavailable):
        await store.ping()


async def test_many_more_callers_than_connections_share_them_in_turn(
    pg_store: tuple[PostgresStore, list[tuple[str, bool]]],
) -> None:
    store, seen = pg_store  # two connections
    pids = await asyncio.gather(*(_backend_pid(store) for _ in range(50)))
    assert len(set(pids)) <= 2
    assert seen == [("pid", False)] * 50
