"""SPEC §2.3, §11: a duplicate held on one replica is woken through Redis when the request it
waits for completes on another, even where PostgreSQL LISTEN is not available (e.g. behind a
transaction-pooling PgBouncer); without a wake-up it would wait for its periodic re-read."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from idemproxy.constants import REDIS_CHANNEL, WAITER_RECHECK_SECONDS
from tests.support.backend import Ledger
from tests.support.redisserver import CachedStoreFactory, ProxyFactory, closed_port_url, wait_for

pytestmark = pytest.mark.postgres

KEY = "Idempotency-Key"
UPSTREAM_DELAY = 0.4
SLOW = f"/pay?delay={UPSTREAM_DELAY}"
WAKE_BUDGET = 0.6  # well under the re-read that would otherwise wake it (~1.6 s later)


async def _post(client: TestClient[Any, Any]) -> tuple[int, bytes, bool, float]:
    async with client.post(SLOW, data=b"{}", headers={KEY: "held"}) as response:
        body = await response.read()
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        return response.status, body, replayed, time.monotonic()


async def _held_across_replicas(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, url: str | None
) -> float:
    """Seconds between the first answer (replica A) and its held duplicate's (replica B)."""
    # The feed's socket operations are bounded by write_timeout: the tests' 0.3 s is shorter
    # than a loaded machine's stalls of the event loop, and a feed given up on wakes nobody.
    stores = [await make_store(listen=False, url=url, write_timeout=2.0) for _ in range(2)]
    first_proxy, second_proxy = [await make_proxy(store) for store in stores]
    first = asyncio.create_task(_post(first_proxy))
    await wait_for(lambda: _claimed(stores[0]))
    status, body, replayed, second_done = await _post(second_proxy)
    first_status, first_body, first_replayed, first_done = await first
    assert (first_status, first_replayed) == (201, False)
    assert (status, body, replayed) == (201, first_body, True)
    return second_done - first_done


async def _claimed(store: Any) -> bool:
    return bool(await store.record.list_jobs())


async def test_a_held_duplicate_on_another_replica_is_woken_through_redis(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, ledger: Ledger
) -> None:
    assert WAKE_BUDGET < WAITER_RECHECK_SECONDS - UPSTREAM_DELAY
    spread = await _held_across_replicas(make_store, make_proxy, url=None)
    assert spread < WAKE_BUDGET, f"woken {spread:.2f}s after the first answer"
    assert ledger.count("held") == 1


async def test_without_redis_the_same_duplicate_waits_for_its_re_read(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, ledger: Ledger
) -> None:
    """The control: the budget above is only met thanks to the Redis wake-up."""
    spread = await _held_across_replicas(make_store, make_proxy, url=closed_port_url())
    assert spread > WAKE_BUDGET
    assert ledger.count("held") == 1


async def test_changes_of_jobs_nobody_waits_for_are_not_published(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis
) -> None:
    """Every replica reads every message: only watched jobs are announced, as with NOTIFY."""
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(REDIS_CHANNEL)
    try:
        client = await make_proxy(await make_store())
        for number in range(3):
            headers = {KEY: f"quiet-{number}"}
            async with client.post("/pay", data=b"{}", headers=headers) as response:
                assert response.status == 201
        await asyncio.sleep(0.3)
        kinds = []
        while (message := await pubsub.get_message(timeout=0.05)) is not None:
            kinds.append(message["type"])
        assert kinds == ["subscribe"]
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
