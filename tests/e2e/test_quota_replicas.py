"""Quotas across replicas (SPEC §9): two proxy processes on one PostgreSQL enforce one in-flight
cap per owner together; a refused request never reaches the backend and claims nothing."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import asyncpg
import pytest

from tests.support.client import send
from tests.support.processes import Backend, StartProxy

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

CAP = 2
REQUESTS = 8
OWNER = hashlib.sha256(b"Bearer e2e-user").hexdigest()  # tests/support/client.py's default


async def test_two_replicas_enforce_one_in_flight_cap(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    env = {"IDEMPROXY_QUOTAS__MAX_IN_FLIGHT": str(CAP)}
    args = ("--upstream", backend.url, "--store", pg_dsn)
    proxies = await asyncio.gather(
        start_proxy(*args, env=env, name="q0"), start_proxy(*args, env=env, name="q1")
    )
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(
            *(
                send(session, proxies[n % 2].url + "/payments?delay=1.5", key=f"k{n}")
                for n in range(REQUESTS)
            )
        )
        other = await send(session, proxies[0].url + "/payments", key="other-k",
                           headers={"Authorization": "Bearer other"})  # fmt: skip
    admitted = [n for n, a in enumerate(answers) if a.status == 201]
    refused = [n for n, a in enumerate(answers) if a.status == 429]
    assert len(admitted) == CAP and len(refused) == REQUESTS - CAP, [a.status for a in answers]
    for n in refused:
        assert answers[n].headers["Idempotency-Error"] == "quota-exceeded"
        assert answers[n].headers["Retry-After"] == "1"
        assert backend.ledger.count(f"k{n}") == 0  # the backend never saw it
    assert sum(backend.ledger.count(f"k{n}") for n in admitted) == CAP
    assert other.status == 201  # another owner is not held back by this one's cap
    conn = await asyncpg.connect(pg_dsn)
    try:
        keys = await conn.fetch("SELECT key FROM idemproxy.jobs WHERE owner = $1", OWNER)
    finally:
        await conn.close()
    assert sorted(row["key"] for row in keys) == sorted(
        f"k{n}" for n in admitted
    )  # nothing claimed

    async with aiohttp.ClientSession() as session:  # the same keys go through once room is made
        retried = [await send(session, proxies[1].url + "/payments?delay=1.5", key=f"k{n}")
                   for n in refused[:2]]  # fmt: skip
    assert [a.status for a in retried] == [201, 201]
