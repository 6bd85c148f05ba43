"""`encryption.require_sealed` (SPEC §11) on every path that serves a stored response: a
response in the clear (from before the key ring, or planted by someone with write access to the
database) is `500 response-unreadable`, never replayed, whether it comes from the store, the
in-process replay cache or a held duplicate's re-read. On SQLite and PostgreSQL (with the
in-process replay cache `serve` builds); Redis in tests/redis/test_redis_require_sealed.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from idemproxy.store.cache.memory import MemoryReplayCache
from idemproxy.store.seal.store import SealingStore
from tests.support.backend import Ledger
from tests.support.keyring import OLD
from tests.support.metrics import counted
from tests.support.proxyapp import ProxyClient, ProxyFactory
from tests.support.proxychecks import KEY, REPLAYED, assert_problem, eventually, wait_for_jobs
from tests.support.rawrows import RawRows

HEADERS = {KEY: "k", "Authorization": "Bearer a"}
STRICT: dict[str, Any] = {"encryption": {"keys": OLD, "require_sealed": True}}


async def _refused(client: ProxyClient, path: str = "/payments") -> None:
    async with client.post(path, data=b"pay", headers=HEADERS) as response:
        await assert_problem(response, "response-unreadable", 500)
        assert REPLAYED not in response.headers


async def test_a_response_in_the_clear_is_refused_from_the_store_and_the_cache(
    proxy: ProxyFactory, ledger: Ledger, store_dsn: str
) -> None:
    async with (await proxy()).post("/payments", data=b"pay", headers=HEADERS) as first:
        assert first.status == 201  # before the key ring: stored in the clear
    lenient = await proxy(encryption={"keys": OLD})
    async with lenient.post("/payments", data=b"pay", headers=HEADERS) as replay:
        assert replay.status == 201 and replay.headers[REPLAYED] == "true"  # the default

    strict = await proxy(**STRICT)  # a restart with require_sealed
    store = strict.app[CONTEXT].store
    assert isinstance(store, SealingStore)
    cache = store.inner if isinstance(store.inner, MemoryReplayCache) else None
    if cache is not None:  # PostgreSQL: the second replay comes from the in-process cache
        await eventually(lambda: cache.watch.live, timeout=10.0)
    for _ in range(2):
        await _refused(strict)
    if cache is not None:
        assert cache.hits >= 1
    assert ledger.count() == 1


async def test_a_response_planted_in_the_clear_is_refused(
    proxy: ProxyFactory, ledger: Ledger, store_dsn: str
) -> None:
    async with (await proxy(**STRICT)).post("/payments", data=b"pay", headers=HEADERS) as first:
        assert first.status == 201
        job_id = first.headers["Idempotency-Job"]
    rows = RawRows(store_dsn)
    await rows.set_job(job_id, "response_key", None)
    await rows.set_job(job_id, "response_headers", '[["X-Planted","1"]]')
    await rows.set_job(job_id, "response_body", b"planted")
    strict = await proxy(**STRICT)
    await _refused(strict)
    assert ledger.count() == 1
    # A stored response that cannot be opened is the proxy failing to answer, not a client's
    # request refused (docs/operations.md, "Metrics"): an alert on `unavailable` sees it.
    registry = strict.app[CONTEXT].metrics.registry
    total = "idemproxy_requests_total"
    assert counted(registry, total, outcome="unavailable", status_class="5xx", source="proxy") == 1
    assert counted(registry, total, outcome="rejected") == 0


async def test_a_held_duplicate_is_refused_a_response_completed_in_the_clear(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    """A replica without the key ring completes the job while a strict one holds its duplicate
    (SPEC §2.3): the duplicate's answer is the stored response, refused in the clear."""
    clear = await proxy()
    strict = await proxy(**STRICT)
    running = asyncio.create_task(clear.post("/payments?delay=2.0", data=b"pay", headers=HEADERS))
    await wait_for_jobs(jobs)
    held_since = time.monotonic()
    await _refused(strict, "/payments?delay=2.0")
    assert time.monotonic() - held_since > 0.3  # it was held, not answered from a completed job
    async with await running as first:
        assert first.status == 201
    assert ledger.count() == 1
