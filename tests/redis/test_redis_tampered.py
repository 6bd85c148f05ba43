"""A Redis entry whose seal someone broke, served by a proxy built from its settings (the
in-process replay cache in front of Redis, then PostgreSQL): every cache drops the copy that
does not open, and the retry is answered from the store of record (SPEC §11)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from idemproxy.config.settings import load_settings
from idemproxy.constants import REDIS_JOB_PREFIX
from idemproxy.proxy.app import create_app
from tests.support.backend import Ledger
from tests.support.keyring import OLD
from tests.support.redisserver import RedisServer, wait_for

pytestmark = pytest.mark.postgres

HEADERS = {"Idempotency-Key": "k1", "Authorization": "Bearer alice"}


async def _entries(client: Redis) -> list[bytes]:
    return [name for name in await client.keys(f"{REDIS_JOB_PREFIX}*") if isinstance(name, bytes)]


async def test_a_tampered_entry_read_through_the_in_process_cache_is_answered_from_the_store(
    backend_url: str, pg_dsn: str, redis_server: RedisServer, redis_client: Redis, ledger: Ledger
) -> None:
    redis = {"url": redis_server.url, "timeout": 10.0, "write_timeout": 10.0}
    settings = load_settings(
        upstream=backend_url, store=pg_dsn, redis=redis, encryption={"keys": OLD}
    )
    async with (
        TestClient(TestServer(create_app(settings))) as client,
        client.post("/pay", data=b"{}", headers=HEADERS) as first,
    ):
        assert first.status == 201
        body = await first.read()
    await wait_for(lambda: _has_entries(redis_client))
    [name] = await _entries(redis_client)
    entry = await redis_client.get(name)
    assert isinstance(entry, bytes)
    flipped = bytearray(entry)
    flipped[-3] ^= 0x40
    await redis_client.set(name, bytes(flipped), keepttl=True)

    # A restart: its in-process cache is empty, and takes the entry from Redis first.
    async with TestClient(TestServer(create_app(settings))) as client:
        for _ in range(3):
            async with client.post("/pay", data=b"{}", headers=HEADERS) as replay:
                assert replay.status == 201, await replay.text()
                assert replay.headers["Idempotent-Replayed"] == "true"
                assert await replay.read() == body
    assert ledger.count() == 1


async def _has_entries(client: Redis) -> bool:
    return bool(await _entries(client))
