"""The store contract runs on four stores: SQLite, PostgreSQL, PostgreSQL behind the in-process
replay cache, as `idemproxy serve` runs it (store/cache/memory.py), and a Citus cluster (a
coordinator and two workers, tests/support/citus.py).

A test asks for the interfaces it exercises (store/ports.py), all of one stack: `hot`, the hot
path through the stack's layers; `operators`, `housekeeping`, `resealing` and `lifecycle`, the
store of record, as the admin API, the background tasks and the CLI reach it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from idemproxy.store.cache.memory import MemoryReplayCache
from idemproxy.store.factory import create_store
from idemproxy.store.layers import StoreStack
from idemproxy.store.ports import (
    Housekeeping,
    JobStore,
    Lifecycle,
    Operators,
    Resealing,
)
from idemproxy.store.watch import JobWatch
from tests.support.stores import CacheBounds

_CACHED = "postgres+memory"
_DSN_FIXTURES = {
    "sqlite": "sqlite_dsn",
    "postgres": "pg_dsn",
    _CACHED: "pg_dsn",
    "citus": "citus_dsn",
}
# A cache that keeps anything a test makes: its bounds have tests of their own.
_UNBOUNDED: CacheBounds = {"max_bytes": 1 << 30, "max_body": 1 << 30, "ttl": 3600.0}


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param(_CACHED, marks=pytest.mark.postgres),
        # A coordinator and two workers of the tests' own, both tables distributed by owner.
        pytest.param("citus", marks=pytest.mark.citus),
    ]
)
def store_dsn(request: pytest.FixtureRequest) -> str:
    dsn: str = request.getfixturevalue(_DSN_FIXTURES[request.param])
    return dsn


@pytest.fixture
async def stack(store_dsn: str, request: pytest.FixtureRequest) -> AsyncIterator[StoreStack]:
    """An open, migrated store on a fresh database; with the cache, once its feed is live."""
    record = create_store(store_dsn)
    cached = request.node.callspec.params.get("store_dsn") == _CACHED
    stack = StoreStack.of(MemoryReplayCache(record, **_UNBOUNDED) if cached else record)
    await stack.open()
    try:
        await record.migrate()
        if cached:
            await wait_until_live(record.watch)
        yield stack
    finally:
        await stack.close()


@pytest.fixture
def hot(stack: StoreStack) -> JobStore:
    return stack.jobs


@pytest.fixture
def operators(stack: StoreStack) -> Operators:
    return stack.record


@pytest.fixture
def housekeeping(stack: StoreStack) -> Housekeeping:
    return stack.record


@pytest.fixture
def resealing(stack: StoreStack) -> Resealing:
    return stack.record


@pytest.fixture
def lifecycle(stack: StoreStack) -> Lifecycle:
    return stack.record


async def wait_until_live(watch: JobWatch) -> None:
    await eventually(lambda: watch.live, "the change feed is live", seconds=10.0)


async def eventually(condition: Callable[[], bool], what: str, *, seconds: float = 5.0) -> None:
    """Poll until `condition()` holds (bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        if condition():
            return
        assert time.monotonic() < deadline, f"not within {seconds}s: {what}"
        await asyncio.sleep(0.01)
