"""The SQLite store hands its connection's thread whole operations (store/sqlite/worker.py): a
batch of claims or completions is one call to the thread and one commit, however many rows it
has; a row the database refuses fails only its caller; and a caller cancelled while its
function runs leaves no transaction half done behind it.

Calls are counted by the worker, statements (BEGIN, COMMIT, savepoints) by sqlite3's trace hook
on the store's own connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from idemproxy.core.types import Claimed, ClaimResult, Intent, StoredResponse
from idemproxy.errors import StoreRefused, StoreUnavailable
from idemproxy.store.factory import sqlite_path
from idemproxy.store.sqlite.store import SqliteStore
from idemproxy.store.sqlite.worker import Worker
from tests.support.stores import opened, record_batches

CONCURRENT = 32
FINE = StoredResponse(201, (("Content-Type", "text/plain"),), b"stored")
# A lone surrogate (a byte that is not UTF-8, decoded with surrogateescape): SQLite refuses it.
UNSTORABLE_KEY = "bad-\udce9"


@pytest.fixture
async def store(sqlite_dsn: str) -> AsyncIterator[SqliteStore]:
    async with opened(SqliteStore(sqlite_path(sqlite_dsn))) as opened_store:
        yield opened_store


@pytest.fixture
async def statements(store: SqliteStore) -> AsyncIterator[list[str]]:
    """Every statement the store's connection runs from here on (traced on its thread)."""
    seen: list[str] = []
    await store.worker.run(lambda db: db.set_trace_callback(seen.append))
    seen.clear()
    yield seen
    await store.worker.run(lambda db: db.set_trace_callback(None))


@pytest.fixture
def batches(store: SqliteStore) -> Iterator[list[tuple[str, int]]]:
    yield record_batches(store)


def _claim(store: SqliteStore, key: str) -> asyncio.Task[ClaimResult]:
    intent = Intent("alice", key, "fp", "POST", "/payments")
    return asyncio.create_task(
        store.claim(intent, str(uuid.uuid4()), "primary", ttl=3600.0, lease=30.0)
    )


def _count(statements: list[str], word: str) -> int:
    return sum(1 for statement in statements if statement.strip().upper().startswith(word))


async def test_a_batch_of_claims_and_one_of_completions_are_each_one_call_and_one_commit(
    store: SqliteStore, statements: list[str], batches: list[tuple[str, int]]
) -> None:
    calls = store.worker.calls
    claims = await asyncio.gather(*(_claim(store, f"k-{i}") for i in range(CONCURRENT)))
    assert all(isinstance(claim, Claimed) for claim in claims)
    assert batches == [("claim", 1), ("claim", CONCURRENT - 1)], "the lead, then all the others"
    assert store.worker.calls - calls == 2, "one call to the thread per batch"
    assert _count(statements, "COMMIT") == 2 and _count(statements, "BEGIN") == 2

    batches.clear()
    statements.clear()
    calls = store.worker.calls
    won = await asyncio.gather(
        *(
            store.complete(claim.job, claim.attempt, FINE, ttl=3600.0)
            for claim in claims
            if isinstance(claim, Claimed)
        )
    )
    assert won == [True] * CONCURRENT
    assert batches == [("complete", 1), ("complete", CONCURRENT - 1)]
    assert store.worker.calls - calls == 2
    assert _count(statements, "COMMIT") == 2


async def test_a_refused_row_fails_only_its_caller_in_the_same_call_and_commit(
    store: SqliteStore, statements: list[str], batches: list[tuple[str, int]]
) -> None:
    calls = store.worker.calls
    keys = ["lead", "good-1", UNSTORABLE_KEY, "good-2"]
    results = await asyncio.gather(*(_claim(store, key) for key in keys), return_exceptions=True)
    assert isinstance(results[2], StoreRefused), results[2]
    assert all(isinstance(results[i], Claimed) for i in (0, 1, 3)), results
    assert batches == [("claim", 1), ("claim", 3)]
    assert store.worker.calls - calls == 2 and _count(statements, "COMMIT") == 2
    assert _count(statements, "ROLLBACK TO") == 1, "only the refused row's savepoint"
    for key in ("lead", "good-1", "good-2"):
        assert await store.get("alice", key) is not None


@contextlib.contextmanager
def _writes_blocked(dsn: str) -> Iterator[sqlite3.Connection]:
    """Another connection holds the write lock: the store's next write waits on its thread."""
    other = sqlite3.connect(sqlite_path(dsn), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        yield other
    finally:
        if other.in_transaction:
            other.execute("ROLLBACK")
        other.close()


async def test_a_caller_cancelled_while_its_function_runs_leaves_no_half_transaction(
    store: SqliteStore, sqlite_dsn: str, batches: list[tuple[str, int]]
) -> None:
    with _writes_blocked(sqlite_dsn) as other:
        lead = _claim(store, "cancelled")
        await asyncio.sleep(0.1)
        assert batches == [("claim", 1)], "its function is on the thread, waiting for the lock"
        lead.cancel()
        await asyncio.sleep(0.1)
        assert not lead.done(), "the caller hears of it only once its function has ended"
        other.execute("ROLLBACK")
        with pytest.raises(asyncio.CancelledError):
            await lead
    # Rolled back, not committed: the caller was cancelled before the commit.
    assert await store.get("alice", "cancelled") is None
    assert not await store.worker.run(lambda db: db.in_transaction), "nothing left open"
    after = await _claim(store, "next")
    assert isinstance(after, Claimed) and after.attempt == 1
    assert await store.get("alice", "next") is not None


async def test_a_caller_cancelled_while_queued_behind_a_function_never_runs(
    store: SqliteStore, sqlite_dsn: str
) -> None:
    with _writes_blocked(sqlite_dsn) as other:
        running = asyncio.create_task(store.migrate())  # a write: it waits for the lock
        await asyncio.sleep(0.05)
        queued = _claim(store, "queued-on-the-thread")
        await asyncio.sleep(0.05)
        queued.cancel()
        other.execute("ROLLBACK")
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert await running == []
    assert await store.get("alice", "queued-on-the-thread") is None


async def test_a_closed_store_is_unavailable(sqlite_dsn: str) -> None:
    store = SqliteStore(sqlite_path(sqlite_dsn))
    async with opened(store):
        pass
    with pytest.raises(StoreUnavailable, match="not open"):
        await store.get("alice", "any")


async def test_a_close_cancelled_while_a_function_runs_still_ends_the_thread(
    sqlite_dsn: str,
) -> None:
    before = set(threading.enumerate())
    worker = Worker()
    await worker.open(sqlite_path(sqlite_dsn), [])
    [thread] = set(threading.enumerate()) - before
    started = threading.Event()
    release = threading.Event()

    def slow(_db: sqlite3.Connection) -> None:
        started.set()
        release.wait(5)

    running = asyncio.create_task(worker.run(slow))
    await asyncio.to_thread(started.wait, 5)
    closing = asyncio.create_task(worker.close())
    await asyncio.sleep(0.05)
    closing.cancel()
    release.set()
    await running
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    thread.join(5)

    assert not worker.is_open
    assert not thread.is_alive()
