"""Quotas under a flood (SPEC §9): one owner's burst of new keys, admitted or refused, does not
stall another owner's. Its claims wait for their turn in the process, not on pooled
connections: a slow turn (here the owner's lock held by another replica) holds one of
them, and other owners' new keys keep their latency. New keys already over a limit are refused
at once, not one by one through the owner's lock."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import asyncpg
import pytest

from tests.support.client import send
from tests.support.processes import Backend, ProxyProcess, StartProxy

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

POOL = 8
FLOOD = 60
HELD = 4.0  # seconds the other replica holds the flooding owner's lock
FLOODER = hashlib.sha256(b"Bearer e2e-user").hexdigest()  # tests/support/client.py's default
OTHER = {"Authorization": "Bearer the-other-owner"}


async def _other_latency(session: aiohttp.ClientSession, proxy: ProxyProcess, tag: str) -> float:
    """The slowest of a few new keys of another owner, one after the other."""
    took = []
    for n in range(3):
        answer = await send(session, f"{proxy.url}/payments", key=f"{tag}-{n}", headers=OTHER)
        assert answer.status == 201, (answer.status, answer.body)
        took.append(answer.done_at - answer.sent_at)
    return max(took)


@pytest.mark.parametrize("in_flight", [100_000, 1], ids=["admitted", "refused"])
async def test_a_flood_of_one_owner_does_not_stall_another(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy, in_flight: int
) -> None:
    env = {
        "IDEMPROXY_QUOTAS__MAX_IN_FLIGHT": str(in_flight),
        "IDEMPROXY_POOL__STORE_CONNECTIONS": str(POOL),
        "IDEMPROXY_POOL__STORE_TIMEOUT": "6s",  # the flood waits out the lock held
    }
    proxy = await start_proxy("--upstream", backend.url, "--store", pg_dsn, env=env)
    replica = await asyncpg.connect(pg_dsn)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        first = asyncio.create_task(
            send(session, f"{proxy.url}/payments?delay={HELD + 3}", key="a-first")
        )
        for _ in range(500):  # until `a-first` is in flight
            if await replica.fetchval("SELECT count(*) FROM idemproxy.jobs"):
                break
            await asyncio.sleep(0.02)
        unloaded = await _other_latency(session, proxy, "calm")
        # Another replica's claim of the flooding owner is slow: it holds the owner's lock
        # (store/sql/postgres/queries.sql `lock_owner`) while the flood arrives.
        await replica.execute("SELECT pg_advisory_lock(hashtextextended($1, 7320417))", FLOODER)
        flood = [
            asyncio.create_task(send(session, f"{proxy.url}/payments", key=f"a{n}"))
            for n in range(FLOOD)
        ]
        try:
            await asyncio.sleep(0.5)  # the flood waits at the proxy for the owner's turn
            loaded = await _other_latency(session, proxy, "flood")
            if in_flight == 1:  # refused while the lock is still held: none waits for a turn
                await asyncio.wait(flood, timeout=HELD - 1.5, return_when=asyncio.ALL_COMPLETED)
                waiting = [n for n, task in enumerate(flood) if not task.done()]
                assert len(waiting) <= 1, f"{len(waiting)} refusals waited for the owner's lock"
        finally:
            await replica.execute("SELECT pg_advisory_unlock_all()")
            await replica.close()
        answers = await asyncio.gather(*flood)
        assert (await first).status == 201
    # Before, each claim of the flood waited for the lock on a pooled connection, all of them
    # taken: the other owner waited until the lock was released (HELD - 0.5 s).
    assert loaded < HELD / 2, (loaded, unloaded)
    expected = 201 if in_flight > 1 else 429  # `a-first` is in flight: every other is refused
    assert [a.status for a in answers] == [expected] * FLOOD
