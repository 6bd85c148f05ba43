"""Erasure across replicas (SPEC §11): `idemproxy jobs purge` against PostgreSQL and Redis while
two proxy processes serve the owner's keys from Redis and from their in-process caches."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sys

import aiohttp
import pytest
from redis.asyncio import Redis

from idemproxy.store.redis.codec import entry_name
from tests.support.client import send
from tests.support.processes import Backend, StartProxy, backend, start_backend, start_proxy
from tests.support.redisserver import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
__all__ = ["backend", "start_backend", "start_proxy"]  # fixtures, used by name

ALICE = "Bearer e2e-user"  # tests/support/client.py's default credential
BOB = {"Authorization": "Bearer bob"}
ALICE_HASH = hashlib.sha256(ALICE.encode()).hexdigest()
# The NOTIFY of each delete reaches the other replica's cache asynchronously: at most this
# long, on a loaded machine (within milliseconds on an idle one).
FEED_DEADLINE = 10.0


async def _cache_entries(session: aiohttp.ClientSession, admin_url: str) -> float:
    async with session.get(admin_url + "/metrics") as response:
        text = await response.text()
    found = re.search(r"^idemproxy_replay_cache_entries (\S+)$", text, re.M)
    assert found is not None, text[:500]
    return float(found[1])


async def _purge(pg_dsn: str, redis_url: str) -> dict[str, object]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idemproxy", "jobs", "purge", "--credential-file", "-",
        "--store", pg_dsn, "--redis", redis_url, "--json",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(ALICE.encode() + b"\n"), 60)
    assert process.returncode == 0, err.decode()
    report: dict[str, object] = json.loads(out)
    return report


async def test_a_purge_reaches_redis_and_every_replicas_cache(
    pg_dsn: str,
    backend: Backend,
    start_proxy: StartProxy,
    redis_server: RedisServer,
    redis_client: Redis,
) -> None:
    args = ("--upstream", backend.url, "--store", pg_dsn, "--redis", redis_server.url)
    first, second = await asyncio.gather(
        start_proxy(*args, name="r0"), start_proxy(*args, name="r1")
    )
    async with aiohttp.ClientSession() as session:
        for key in ("k1", "k2"):
            assert (await send(session, first.url + "/payments", key=key)).status == 201
            for _ in range(2):  # the second replica keeps it in its in-process cache
                answer = await send(session, second.url + "/payments", key=key)
                assert answer.replayed
        bobs = await send(session, first.url + "/payments", key="k1", headers=BOB)
        assert bobs.status == 201
        assert (await send(session, second.url + "/payments", key="k1", headers=BOB)).replayed
        assert await _cache_entries(session, second.admin_url) == 3
        for key in ("k1", "k2"):
            assert await redis_client.exists(entry_name(ALICE_HASH, key))

        report = await _purge(pg_dsn, redis_server.url)
        assert (report["owner"], report["removed_jobs"], report["left"]) == (ALICE_HASH, 2, [])

        for key in ("k1", "k2"):  # Redis holds nothing of alice's: no entry under her keys
            assert not await redis_client.exists(entry_name(ALICE_HASH, key))
        entries = [name.decode() async for name in redis_client.scan_iter("idemproxy:job:*")]
        assert entries == [entry_name(hashlib.sha256(b"Bearer bob").hexdigest(), "k1")]
        for _ in range(int(FEED_DEADLINE / 0.05)):  # the deletes' notifications, on their way
            if await _cache_entries(session, second.admin_url) == 1:
                break
            await asyncio.sleep(0.05)
        assert await _cache_entries(session, second.admin_url) == 1  # bob's only

        executed = backend.ledger.count("k1")
        again = await send(session, second.url + "/payments", key="k1")
        assert again.status == 201 and not again.replayed
        assert backend.ledger.count("k1") == executed + 1  # erased: it executes again
        bob_again = await send(session, second.url + "/payments", key="k1", headers=BOB)
        assert bob_again.replayed and bob_again.body == bobs.body
        assert backend.ledger.count("k1") == executed + 1
