"""Three proxy processes on one PostgreSQL database, sending overlapping keys at full rate: their
group-committed claims and completions (store/batching.py) race for the same keys in batches of
many rows, and still one execution per key, no deadlock and no serialization failure (SPEC §2.2,
§11). Batches insert their rows in key order, so two replicas' batches over the same keys wait
for each other in one order.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from tests.support.client import Answer, send

if TYPE_CHECKING:
    from tests.support.processes import ProxyProcess

    from .conftest import Backend, StartProxy

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

REPLICAS = 3
# Each round sends the same new keys to every replica at once, in a different order on each:
# every replica's batch then holds the same keys, arrived in its own order.
KEYS_PER_ROUND = 16
ROUNDS = 30
# A small pool per process: the machine's PostgreSQL is shared (at most 100 connections).
ENV = {"IDEMPROXY_POOL__STORE_CONNECTIONS": "6", "IDEMPROXY_POOL__LEASE_CONNECTIONS": "1"}
_BATCH_SAMPLE = re.compile(
    r'^idemproxy_store_batch_rows_(count|sum)\{kind="(\w+)"\} (\S+)$', re.MULTILINE
)


async def _round(
    session: aiohttp.ClientSession,
    proxies: list[ProxyProcess],
    keys: list[str],
    plan: random.Random,
) -> list[tuple[str, Answer]]:
    sends: list[Coroutine[Any, Any, tuple[str, Answer]]] = []
    for proxy in proxies:
        order = plan.sample(keys, len(keys))
        sends.extend(_send(session, proxy, key) for key in order)
    return list(await asyncio.gather(*sends))


async def _send(
    session: aiohttp.ClientSession, proxy: ProxyProcess, key: str
) -> tuple[str, Answer]:
    return key, await send(session, proxy.url + "/payments", key=key)


async def _batches(session: aiohttp.ClientSession, proxy: ProxyProcess) -> dict[str, float]:
    async with session.get(proxy.admin_url + "/metrics") as response:
        text = await response.text()
    return {f"{kind}_{what}": float(value) for what, kind, value in _BATCH_SAMPLE.findall(text)}


async def test_three_replicas_overlapping_keys_execute_each_key_once(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    proxies = await asyncio.gather(
        *(
            start_proxy("--upstream", backend.url, "--store", pg_dsn, env=ENV, name=f"r{i}")
            for i in range(REPLICAS)
        )
    )
    plan = random.Random(20)
    answers: list[tuple[str, Answer]] = []
    connector = aiohttp.TCPConnector(limit=KEYS_PER_ROUND * REPLICAS)
    async with aiohttp.ClientSession(connector=connector) as session:
        for round_ in range(ROUNDS):
            keys = [f"overlap-{round_}-{i}" for i in range(KEYS_PER_ROUND)]
            answers.extend(await _round(session, list(proxies), keys, plan))
        batches = [await _batches(session, proxy) for proxy in proxies]

    described = [p.describe() for p in proxies]
    statuses = {answer.status for _key, answer in answers}
    assert statuses == {201}, (statuses, described)
    sent = {key for key, _answer in answers}
    for key in sent:
        assert backend.ledger.count(key) == 1, (key, described)
    jobs: dict[str, set[str | None]] = {}
    for key, answer in answers:
        jobs.setdefault(key, set()).add(answer.job)
    assert all(len(ids) == 1 for ids in jobs.values()), "one job per key, on every replica"
    for proxy in proxies:
        log = proxy.stderr().lower()
        for problem in ("deadlock", "serializ", "store error", "traceback"):
            assert problem not in log, proxy.describe()
    # The batching ran: some statement carried more than one row.
    claims = sum(b.get("claim_sum", 0) for b in batches)
    statements = sum(b.get("claim_count", 0) for b in batches)
    assert statements > 0 and claims > statements, batches
