"""Three proxy processes on one PostgreSQL, with and without Redis (issue: many replicas).

Concurrent duplicates of several keys, spread over the three replicas: one backend execution per
key, every answer of a key byte-identical, and every held duplicate on every replica answered as
soon as the response is stored — within a fraction of the 2 s re-read interval, so by a wake-up.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from idemproxy.constants import WAITER_RECHECK_SECONDS
from tests.support.client import send
from tests.support.processes import Backend, StartProxy, backend, start_backend, start_proxy
from tests.support.redisserver import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
__all__ = ["backend", "start_backend", "start_proxy"]  # fixtures, used by name

REPLICAS = 3
KEYS = 4
PER_KEY = 9
UPSTREAM_DELAY = 0.3
WAKE_BUDGET = 1.0  # well under WAITER_RECHECK_SECONDS - UPSTREAM_DELAY


@pytest.mark.parametrize("with_redis", [False, True], ids=["postgres-only", "with-redis"])
async def test_duplicates_over_three_replicas_execute_once_and_wake_at_once(
    pg_dsn: str,
    backend: Backend,
    start_proxy: StartProxy,
    redis_server: RedisServer,
    with_redis: bool,
) -> None:
    assert WAKE_BUDGET < WAITER_RECHECK_SECONDS - UPSTREAM_DELAY
    extra = ("--redis", redis_server.url) if with_redis else ()
    proxies = await asyncio.gather(
        *(
            start_proxy("--upstream", backend.url, "--store", pg_dsn, *extra, name=f"r{i}")
            for i in range(REPLICAS)
        )
    )
    url = f"/payments?delay={UPSTREAM_DELAY}"
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(
            *(
                send(session, proxies[n % REPLICAS].url + url, key=f"k{n % KEYS}")
                for n in range(KEYS * PER_KEY)
            )
        )
    for k in range(KEYS):
        key = f"k{k}"
        mine = [a for n, a in enumerate(answers) if n % KEYS == k]
        assert backend.ledger.count(key) == 1, [p.describe() for p in proxies]
        assert {a.status for a in mine} == {201}
        assert len({a.body for a in mine}) == 1
        first = min(a.done_at for a in mine if not a.replayed)
        spread = max(a.done_at for a in mine) - first
        assert spread < WAKE_BUDGET, f"{key}: held duplicates woke after {spread:.2f}s"
