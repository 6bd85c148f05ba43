"""Replays from the in-process cache, through the proxy as `idemproxy serve` builds it on
PostgreSQL (SPEC §7, §11): the same answers as from the store, and never a deleted job."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from idemproxy.admin.app import Readiness, create_admin_app
from idemproxy.config.settings import load_settings
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.app import create_app
from idemproxy.store.cache.memory import MemoryReplayCache
from idemproxy.store.factory import serving_store
from idemproxy.store.layers import StoreStack
from tests.support.backend import Ledger
from tests.support.proxychecks import JOB, KEY, REPLAYED, eventually

from .conftest import ServeListener

pytestmark = pytest.mark.postgres

Client = TestClient[Any, Any]


class Proxy:
    def __init__(self, client: Client, admin: Client, store: MemoryReplayCache) -> None:
        self.client, self.admin, self.store = client, admin, store

    async def post(
        self, key: str, *, user: str, amount: int = 10
    ) -> tuple[int, dict[str, str], bytes]:
        request: dict[str, Any] = {
            "json": {"amount": amount},
            "headers": {KEY: key, "X-User": user},
        }
        async with self.client.post("/payments", **request) as response:
            return response.status, dict(response.headers), await response.read()

    async def metric(self, name: str, **labels: str) -> float:
        async with self.admin.get("/metrics") as response:
            text = await response.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return sample.value
        raise AssertionError(f"{name} {labels} not exported")


@pytest.fixture
async def proxy(replicated_dsn: str, backend_url: str) -> AsyncIterator[Proxy]:
    """The proxy and its admin listener, on the store `idemproxy serve` would build: on
    PostgreSQL, then on a Citus cluster (whose deletions must be announced as well)."""
    pg_dsn = replicated_dsn
    settings = load_settings(
        upstream=backend_url, store=pg_dsn, owner={"strategy": "header:X-User"}
    )
    store = serving_store(settings)
    assert isinstance(store, MemoryReplayCache)
    await StoreStack.of(store).open()
    metrics = Metrics()
    app = create_app(settings, store=store, metrics=metrics)
    admin_app = create_admin_app(settings, store.record, Readiness(), metrics=metrics)
    async with (
        TestClient(ServeListener(app, settings.server)) as client,
        TestClient(TestServer(admin_app)) as admin,
    ):
        await eventually(lambda: store.watch.live, timeout=10.0)
        yield Proxy(client, admin, store)
    await StoreStack.of(store).close()


async def test_duplicates_are_replayed_from_memory_with_what_the_store_would_give(
    proxy: Proxy, ledger: Ledger
) -> None:
    first = await proxy.post("k1", user="alice")
    replays = [await proxy.post("k1", user="alice") for _ in range(3)]
    assert first[0] == 201
    for status, headers, body in replays:
        assert (status, body) == (first[0], first[2])
        assert headers[REPLAYED] == "true" and headers[JOB] == first[1][JOB]
        assert headers["Location"] == first[1]["Location"]
    assert ledger.count("k1") == 1
    assert await proxy.metric("idemproxy_replay_cache_hits_total") == 3
    assert await proxy.metric("idemproxy_requests_total", outcome="replayed") == 3
    assert await proxy.metric("idemproxy_replay_cache_entries") == 1
    assert await proxy.metric("idemproxy_replay_cache_bytes") > len(first[2])


async def test_another_payload_is_still_refused_and_another_owner_never_served(
    proxy: Proxy, ledger: Ledger
) -> None:
    await proxy.post("k1", user="alice")
    status, headers, body = await proxy.post("k1", amount=99, user="alice")
    assert status == 409 and headers["Idempotency-Error"] == "payload-mismatch", body
    assert await proxy.metric("idemproxy_replay_cache_hits_total") == 1  # answered from memory
    status, headers, _ = await proxy.post("k1", user="bob")
    assert status == 201 and REPLAYED not in headers  # bob's own first request
    assert ledger.count("k1") == 2


async def test_a_job_deleted_on_the_admin_api_is_never_replayed(
    proxy: Proxy, ledger: Ledger
) -> None:
    _, headers, _ = await proxy.post("k1", user="alice")
    async with proxy.admin.delete(f"/jobs/{headers[JOB]}") as deleted:
        assert deleted.status == 204
    status, again, _ = await proxy.post("k1", user="alice")
    assert status == 201 and REPLAYED not in again and again[JOB] != headers[JOB]
    assert ledger.count("k1") == 2


async def test_a_job_deleted_by_the_jobs_cli_in_another_process_is_not_replayed(
    proxy: Proxy, ledger: Ledger, replicated_dsn: str
) -> None:
    pg_dsn = replicated_dsn
    _, headers, _ = await proxy.post("k1", user="alice")
    assert (await proxy.post("k1", user="alice"))[1][REPLAYED] == "true"
    cli = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "idemproxy",
        "jobs",
        "delete",
        headers[JOB],
        "--store",
        pg_dsn,
        stdout=asyncio.subprocess.DEVNULL,
    )
    assert await asyncio.wait_for(cli.wait(), timeout=60) == 0
    # The deletion's announcement reaches this process within moments of the CLI's commit.
    await eventually(lambda: proxy.store.entries == 0, timeout=5.0)
    status, again, _ = await proxy.post("k1", user="alice")
    assert status == 201 and REPLAYED not in again
    assert ledger.count("k1") == 2
