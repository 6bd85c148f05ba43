"""Lease renewals on connections of their own (SPEC §3.5, store/postgres/renewals.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from idemproxy.config.settings import load_settings
from idemproxy.core.types import Claimed, Intent
from idemproxy.store.factory import serving_store
from idemproxy.store.layers import StoreStack
from idemproxy.store.ports import JobStore
from idemproxy.store.postgres.store import Connections, PostgresStore

pytestmark = pytest.mark.postgres


async def _claimed(store: JobStore, key: str) -> Claimed:
    intent = Intent(owner="o", key=key, fingerprint="f", method="POST", path="/pay")
    claimed = await store.claim(intent, str(uuid.uuid4()), "http://up", ttl=60, lease=5)
    assert isinstance(claimed, Claimed)
    return claimed


async def test_a_renewal_does_not_wait_for_the_request_pool(pg_dsn: str) -> None:
    store = PostgresStore(
        pg_dsn, connections=Connections(maximum=1, lease=1), command_timeout=2.0, listen=False
    )
    seen: list[tuple[str, bool]] = []
    store.observer = lambda operation, _seconds, failed: seen.append((operation, failed))
    await store.open()
    try:
        await store.migrate()
        job = (await _claimed(store, "k")).job
        busy = asyncio.create_task(store._run("busy", lambda c: c.execute("SELECT pg_sleep(1)")))
        await asyncio.sleep(0.1)  # the pool's one connection is taken
        started = time.monotonic()
        assert await store.renew_lease(job, lease=5)
        assert time.monotonic() - started < 0.5
        assert not busy.done()
        await busy
        assert ("renew_lease", False) in seen  # timed for the metrics like every store call
    finally:
        await store.close()


async def test_one_store_connection_is_a_working_pool(pg_dsn: str) -> None:
    """`pool.store_connections: 1`: asyncpg refuses a min_size above max_size."""
    settings = load_settings(upstream="http://u:1", store=pg_dsn, pool={"store_connections": 1})
    stack = StoreStack.of(serving_store(settings))
    await stack.open()
    try:
        await stack.record.migrate()
        job = (await _claimed(stack.jobs, "one")).job
        assert await stack.jobs.renew_lease(job, lease=5)
        await stack.record.ping()
    finally:
        await stack.close()
