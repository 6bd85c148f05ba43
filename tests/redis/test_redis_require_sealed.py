"""`encryption.require_sealed` (SPEC §11) on a replay answered from Redis: a response cached in
the clear, by a proxy without the key ring, is `500 response-unreadable` for a proxy that
requires sealed responses, as it is from the store."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from idemproxy.config.settings import load_settings
from idemproxy.proxy.app import create_app
from tests.support.backend import Ledger
from tests.support.keyring import OLD
from tests.support.redisserver import RedisServer, cached_entries, wait_for

pytestmark = pytest.mark.postgres

HEADERS = {"Idempotency-Key": "k1", "Authorization": "Bearer alice"}


async def test_a_response_cached_in_the_clear_is_refused(
    backend_url: str, pg_dsn: str, redis_server: RedisServer, redis_client: Redis, ledger: Ledger
) -> None:
    # The defaults (50 ms a lookup, 0.5 s a write) take a Redis that a loaded machine delays for
    # one that is down, and bypass it for a while: this test is not about that.
    redis = {"url": redis_server.url, "timeout": 10.0, "write_timeout": 10.0}
    common: dict[str, Any] = {"upstream": backend_url, "store": pg_dsn, "redis": redis}
    clear = load_settings(**common)
    async with TestClient(TestServer(create_app(clear))) as client:
        async with client.post("/pay", data=b"{}", headers=HEADERS) as first:
            assert first.status == 201
        await wait_for(lambda: _cached(redis_client))
    strict = load_settings(**common, encryption={"keys": OLD, "require_sealed": True})
    async with TestClient(TestServer(create_app(strict))) as client:
        for _ in range(2):
            async with client.post("/pay", data=b"{}", headers=HEADERS) as replay:
                assert replay.status == 500, await replay.text()
                assert replay.headers["Idempotency-Error"] == "response-unreadable"
    assert ledger.count() == 1


async def _cached(client: Redis) -> bool:
    return await cached_entries(client) > 0
