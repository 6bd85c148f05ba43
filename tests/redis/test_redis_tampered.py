"""A Redis entry whose seal someone broke, served by a proxy built from its settings (the
in-process replay cache in front of Redis, then PostgreSQL): every cache drops the copy that
does not open, and the retry is answered from the store of record (SPEC §11)."""

from __future__ import annotations

import json

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


async def _has_entries(client: Redis, count: int = 1) -> bool:
    return len(await _entries(client)) >= count


async def test_another_payloads_fingerprint_written_into_an_entry_is_still_a_409(
    backend_url: str, pg_dsn: str, redis_server: RedisServer, redis_client: Redis, ledger: Ledger
) -> None:
    """An entry's fingerprint is in the clear beside its sealed response; with encryption the
    entry is tagged under the ring, so one whose fingerprint someone replaced with another
    payload's is a miss, and that payload is refused as the store refuses it (SPEC §11, §2.3),
    never answered with the first payload's response."""
    redis = {"url": redis_server.url, "timeout": 10.0, "write_timeout": 10.0}
    settings = load_settings(
        upstream=backend_url, store=pg_dsn, redis=redis, encryption={"keys": OLD}
    )
    other = {**HEADERS, "Idempotency-Key": "k2"}
    async with TestClient(TestServer(create_app(settings))) as client:
        for headers, body in ((HEADERS, b'{"amount":1}'), (other, b'{"amount":1000}')):
            async with client.post("/pay", data=body, headers=headers) as first:
                assert first.status == 201
        await wait_for(lambda: _has_entries(redis_client, 2))
    entries = {}
    for name in await _entries(redis_client):
        entry = await redis_client.get(name)
        assert isinstance(entry, bytes) and entry.startswith(b"3")  # tagged
        entries[name] = entry
    fingerprints = {name: _field(entry, "fp") for name, entry in entries.items()}
    for name, entry in entries.items():  # each entry given the other one's fingerprint
        [theirs] = [fp for other_name, fp in fingerprints.items() if other_name != name]
        await redis_client.set(name, entry.replace(fingerprints[name], theirs), keepttl=True)

    async with TestClient(TestServer(create_app(settings))) as client:
        async with client.post("/pay", data=b'{"amount":1000}', headers=HEADERS) as swapped:
            assert swapped.status == 409
            assert swapped.headers["Idempotency-Error"] == "payload-mismatch"
        async with client.post("/pay", data=b'{"amount":1}', headers=HEADERS) as retry:
            assert (retry.status, retry.headers["Idempotent-Replayed"]) == (201, "true")
    assert ledger.count() == 2


def _field(entry: bytes, name: str) -> bytes:
    """A field of a tagged entry's JSON line, as it is written there."""
    head = entry.split(b"\n")[1]
    value = json.loads(head[1:])[name]
    return json.dumps(value).encode()
