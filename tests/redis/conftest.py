"""Fixtures for the Redis tests: a throwaway `redis-server` of their own, the cached store on a
fresh PostgreSQL database, and the real proxy app in front of the recording backend.

Each test starts its own `redis-server` on a free loopback port, with persistence off
(`--save "" --appendonly no`) and its files in the test's `tmp_path`, so that it can be
stopped, restarted and paused (SIGSTOP) freely; the shared server on 6379 is never touched.
Without `redis-server` on PATH these tests are skipped, saying so, except where every test must
run (IDEMPROXY_TEST_REQUIRE_ALL=1, as CI sets it): there they fail.

No `__init__.py` here on purpose: a `redis` package under tests/ would shadow redis-py.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from idemproxy.config.settings import load_settings
from idemproxy.proxy.app import create_app
from idemproxy.store.layers import StoreStack
from idemproxy.store.redis.cache import RedisCachedStore, RedisCacheOptions
from tests.support.backend import Ledger, backend_app
from tests.support.prerequisites import missing
from tests.support.redisserver import (
    LOOKUP_TIMEOUT,
    WRITE_TIMEOUT,
    CachedStoreFactory,
    ProxyFactory,
    RedisServer,
    SpyStore,
)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server is not on PATH (apt-get install redis-server)")
    server = RedisServer(binary, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A separate client, to look into (and tamper with) the test's Redis."""
    client = Redis.from_url(redis_server.url, socket_timeout=2.0)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def make_store(pg_dsn: str, redis_server: RedisServer) -> AsyncIterator[CachedStoreFactory]:
    """`await make_store(listen=True, url=None, **options)`: an open `RedisCachedStore` over a
    `SpyStore` on the test's database (its `.inner`), closed at teardown."""
    stores: list[RedisCachedStore] = []

    async def make(*, listen: bool = True, url: str | None = None, **options: Any) -> Any:
        inner = SpyStore(pg_dsn, listen=listen)
        options = {"timeout": LOOKUP_TIMEOUT, "write_timeout": WRITE_TIMEOUT, **options}
        store = RedisCachedStore.from_url(
            inner, url or redis_server.url, RedisCacheOptions(**options)
        )
        await StoreStack.of(store).open()
        stores.append(store)
        return store

    try:
        yield make
    finally:
        for store in reversed(stores):
            await StoreStack.of(store).close()


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
async def backend_url(ledger: Ledger) -> AsyncIterator[str]:
    server = TestServer(backend_app(ledger))
    await server.start_server()
    try:
        yield f"http://{server.host}:{server.port}"
    finally:
        await server.close()


@pytest.fixture
async def make_proxy(backend_url: str, pg_dsn: str) -> AsyncIterator[ProxyFactory]:
    """`await make_proxy(store, **settings)`: the proxy app on an injected (cached) store."""
    clients: list[TestClient[Any, Any]] = []

    async def make(store: RedisCachedStore, **overrides: Any) -> TestClient[Any, Any]:
        settings = load_settings(upstream=backend_url, store=pg_dsn, **overrides)
        client = TestClient(
            TestServer(create_app(settings, store=store)),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        await client.start_server()
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for client in reversed(clients):
            await client.close()
