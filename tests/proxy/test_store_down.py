"""SPEC §11: when the store is unreachable, governed requests fail closed and are not forwarded."""

from __future__ import annotations

from urllib.parse import urlsplit

import asyncpg
import pytest

from idemproxy.proxy.context import CONTEXT
from idemproxy.store.cache.memory import MemoryReplayCache
from idemproxy.store.factory import create_store
from tests.support.backend import Ledger
from tests.support.proxychecks import KEY, assert_problem, eventually

from .conftest import ProxyFactory


async def test_closed_store_answers_503_and_forwards_nothing(
    make_proxy: ProxyFactory, store_dsn: str, ledger: Ledger
) -> None:
    store = create_store(store_dsn)
    await store.open()
    await store.migrate()
    await store.close()  # the proxy's store is gone from under it
    client = await make_proxy(store=store_dsn, inject_store=store)

    for key in ("one", "two"):
        async with client.post("/payments", data=b"pay", headers={KEY: key}) as response:
            await assert_problem(response, "store-unavailable", 503)
            assert int(response.headers["Retry-After"]) >= 1
    assert ledger.count() == 0
    async with client.get("/payments") as response:  # pass-through needs no store
        assert response.status == 201
    assert ledger.count() == 1


@pytest.mark.postgres
@pytest.mark.parametrize("replay_cache", [0, 1 << 20], ids=["no-replay-cache", "replay-cache"])
async def test_postgres_going_away_fails_closed_and_pass_through_still_works(
    make_proxy: ProxyFactory, pg_dsn: str, pg_server_dsn: str, ledger: Ledger, replay_cache: int
) -> None:
    client = await make_proxy(
        store=pg_dsn, pool={"store_timeout": 1.0}, replay_cache={"max_bytes": replay_cache}
    )
    async with client.post("/payments", data=b"pay", headers={KEY: "before"}) as response:
        assert response.status == 201

    database = urlsplit(pg_dsn).path.lstrip("/")
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", database
        )
    finally:
        await admin.close()
    if replay_cache:
        # "before" is in the proxy's in-process replay cache, which answers it from memory
        # until its change feed notices the loss (at once here: the connection was closed;
        # docs/operations.md). From then on it is empty and off.
        store = client.app[CONTEXT].store
        assert isinstance(store, MemoryReplayCache)
        await eventually(lambda: not store.watch.live and store.entries == 0)

    for key in ("before", "after"):  # neither a replay nor a new job can be decided safely
        async with client.post("/payments", data=b"pay", headers={KEY: key}) as response:
            await assert_problem(response, "store-unavailable", 503)
            assert int(response.headers["Retry-After"]) >= 1
    assert ledger.count() == 1
    async with client.get("/payments") as response:
        assert response.status == 201
    assert ledger.count() == 2


async def test_on_store_error_passthrough_forwards_untracked(
    make_proxy: ProxyFactory, store_dsn: str, ledger: Ledger
) -> None:
    store = create_store(store_dsn)
    await store.open()
    await store.close()
    client = await make_proxy(store=store_dsn, inject_store=store, on_store_error="passthrough")
    for _ in range(2):
        async with client.post("/payments", data=b"pay", headers={KEY: "k"}) as response:
            assert response.status == 201
            assert "Idempotent-Replayed" not in response.headers
    assert [e.body for e in ledger.executions] == [b"pay", b"pay"]
