"""SPEC §11: Redis is never the source of truth. Stopped, restarted, stalled or never there,
the proxy keeps answering correctly from PostgreSQL alone, and uses Redis again by itself."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from idemproxy.proxy.context import CONTEXT
from tests.support.backend import Ledger
from tests.support.redisserver import (
    CachedStoreFactory,
    ProxyFactory,
    RedisServer,
    closed_port_url,
)

pytestmark = pytest.mark.postgres

KEY = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"

# The production default: what a request pays at most for a Redis that answers nothing.
STALLED_LOOKUP_TIMEOUT = 0.05


async def _post(client: TestClient[Any, Any], key: str) -> tuple[int, bool, bytes, float]:
    started = time.monotonic()
    headers = {KEY: key, "Content-Type": "application/json"}
    async with client.post("/pay", data=b'{"amount": 1}', headers=headers) as response:
        body = await response.read()
        replayed = response.headers.get(REPLAYED) == "true"
        return response.status, replayed, body, time.monotonic() - started


class Traffic:
    """Concurrent clients sending new keys and duplicates of earlier ones; records every answer."""

    def __init__(self, client: TestClient[Any, Any], workers: int = 6) -> None:
        self.client = client
        self.workers = workers
        self.answers: dict[str, list[tuple[int, bool, bytes]]] = defaultdict(list)
        self._numbers = itertools.count()
        self._stop = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self.workers)))

    def stop(self) -> None:
        self._stop.set()

    async def _worker(self) -> None:
        while not self._stop.is_set():
            number = next(self._numbers)
            # Every third request is new; the others repeat one of the last few keys.
            key = f"k{number}" if number % 3 == 0 else f"k{max(0, number - number % 3 - 3)}"
            status, replayed, body, _ = await _post(self.client, key)
            self.answers[key].append((status, replayed, body))

    def check(self, ledger: Ledger) -> int:
        """One execution per key, every answer a 201, every duplicate the original's bytes."""
        for key, answers in self.answers.items():
            assert {status for status, _, _ in answers} == {201}, (key, answers)
            assert len({body for _, _, body in answers}) == 1, key
            assert sum(not replayed for _, replayed, _ in answers) == 1, key
            assert ledger.count(key) == 1, key
        return sum(len(a) for a in self.answers.values())


async def _served_from_cache(store: Any, client: TestClient[Any, Any], key: str) -> bool:
    store.inner.calls.clear()
    status, replayed, _, _ = await _post(client, key)
    assert status == 201 and replayed
    return not store.inner.calls


async def _until_cached(store: Any, client: TestClient[Any, Any], key: str) -> None:
    deadline = time.monotonic() + 6.0
    while not await _served_from_cache(store, client, key):
        assert time.monotonic() < deadline, "the cache was not used again"
        await asyncio.sleep(0.1)


async def test_redis_stopped_mid_traffic_then_restarted(
    make_store: CachedStoreFactory,
    make_proxy: ProxyFactory,
    redis_server: RedisServer,
    ledger: Ledger,
) -> None:
    store = await make_store()
    client = await make_proxy(store)
    await _post(client, "warm")
    await _until_cached(store, client, "warm")

    assert _redis_up(client) == 1
    traffic = Traffic(client)
    running = asyncio.create_task(traffic.run())
    await asyncio.sleep(0.4)
    redis_server.stop()  # mid-traffic: connections break, lookups and writes fail
    await asyncio.sleep(0.8)
    assert _redis_up(client) == 0  # an SRE's alert says so, not only a falling hit ratio
    redis_server.start()  # empty: nothing persisted
    await asyncio.sleep(0.4)
    traffic.stop()
    await running
    assert traffic.check(ledger) > 50

    # It recovers by itself: completions are cached and replays served from Redis again.
    await _post(client, "after")
    await _until_cached(store, client, "after")
    assert ledger.count("after") == 1
    assert _redis_up(client) == 1


async def test_redis_up_turns_1_again_without_traffic_once_redis_is_back(
    make_store: CachedStoreFactory,
    make_proxy: ProxyFactory,
    redis_server: RedisServer,
) -> None:
    """docs/operations.md, IdemproxyRedisDown: the gauge says whether Redis answers, so an
    idle proxy must not keep saying 0 (and keep the alert firing) until its next request: the
    wake-up feed's own calls tell it too."""
    store = await make_store()
    client = await make_proxy(store)
    await _post(client, "warm")
    await _until_cached(store, client, "warm")
    redis_server.stop()
    await _post(client, "down")  # a lookup fails: down
    assert _redis_up(client) == 0
    redis_server.start()
    deadline = time.monotonic() + 10.0
    while _redis_up(client) != 1:
        assert time.monotonic() < deadline, "idemproxy_redis_up stayed 0 with Redis back"
        await asyncio.sleep(0.1)


def _redis_up(client: TestClient[Any, Any]) -> float | None:
    """`idemproxy_redis_up` as the proxy's /metrics shows it."""
    value: float | None = client.app[CONTEXT].metrics.registry.get_sample_value(
        "idemproxy_redis_up"
    )
    return value


async def test_a_stalled_redis_costs_at_most_the_lookup_timeout(
    make_store: CachedStoreFactory,
    make_proxy: ProxyFactory,
    redis_server: RedisServer,
    ledger: Ledger,
) -> None:
    store = await make_store(timeout=STALLED_LOOKUP_TIMEOUT, write_timeout=0.3)
    client = await make_proxy(store)
    await _post(client, "stalled")
    await _until_cached(store, client, "stalled")
    baseline = max([(await _post(client, f"base{i}"))[3] for i in range(5)])

    redis_server.pause()  # SIGSTOP: the server accepts nothing and answers nothing
    try:
        slowest = 0.0
        for number in range(20):
            status, replayed, _, took = await _post(
                client, "stalled" if number % 2 else f"n{number}"
            )
            assert status == 201 and replayed == bool(number % 2)
            slowest = max(slowest, took)
    finally:
        redis_server.resume()
    # Generous slack for a busy machine; without the timeout a request would wait for the
    # socket timeout (0.3 s here) or forever.
    assert slowest < baseline + STALLED_LOOKUP_TIMEOUT + 0.15, (slowest, baseline)
    assert ledger.count("stalled") == 1

    await _until_cached(store, client, "stalled")


async def test_redis_down_from_the_start_changes_nothing_but_speed(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, ledger: Ledger
) -> None:
    store = await make_store(url=closed_port_url())
    client = await make_proxy(store)
    first = await _post(client, "k")
    again = await _post(client, "k")
    assert first[:3] == (201, False, first[2])
    assert again[:3] == (201, True, first[2])
    assert ledger.count("k") == 1
    assert store.inner.calls["claim"] == 2
