"""SPEC §11 on a Citus cluster: a worker whose PostgreSQL is killed (or frozen) mid-run fails
closed the owners whose shards it holds (503, nothing forwarded), while owners whose shards are on
the other worker are still served; when it comes back, so do its owners."""

from __future__ import annotations

import time

import asyncpg
import pytest

from tests.support.backend import Ledger
from tests.support.citus import CitusCluster
from tests.support.proxyapp import ProxyClient, ProxyFactory
from tests.support.proxychecks import KEY, assert_problem

pytestmark = pytest.mark.citus

USERS = [f"user-{n}" for n in range(12)]
RECOVERY_SECONDS = 30.0
STORE_TIMEOUT = 3.0


async def owners_by_worker(dsn: str) -> dict[int, list[str]]:
    """The users (by their `setup-<user>` job's key) on each worker's port."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT j.key, p.nodeport FROM idemproxy.jobs j JOIN pg_dist_shard_placement p"
            " ON p.shardid = get_shard_id_for_distribution_column('idemproxy.jobs', j.owner)"
        )
    finally:
        await conn.close()
    placed: dict[int, list[str]] = {}
    for row in rows:
        placed.setdefault(row["nodeport"], []).append(row["key"].removeprefix("setup-"))
    return placed


async def post(client: ProxyClient, user: str, key: str) -> int:
    headers = {KEY: key, "X-User": user}
    async with client.post("/payments", data=b"pay", headers=headers) as response:
        if response.status == 503:
            await assert_problem(response, "store-unavailable", 503)
        return response.status


@pytest.mark.parametrize("failure", ["killed", "frozen"])
async def test_a_dead_worker_fails_its_owners_closed_and_spares_the_others(
    make_proxy: ProxyFactory,
    citus_cluster: CitusCluster,
    citus_dsn: str,
    ledger: Ledger,
    failure: str,
) -> None:
    """Killed: its PostgreSQL gets SIGKILL (connections refused). Frozen: SIGSTOP (connections
    open, nothing answers), so that each of its owners' requests waits for the store timeout."""
    # No replay cache: every answer here comes from the store (the cache has tests of its own).
    client = await make_proxy(
        store=citus_dsn,
        pool={"store_timeout": STORE_TIMEOUT},
        owner={"strategy": "header:X-User"},
        replay_cache={"max_bytes": 0},
    )
    for user in USERS:
        assert await post(client, user, f"setup-{user}") == 201
    placed = await owners_by_worker(citus_dsn)
    assert len(placed) == 2, placed  # twelve owners over 32 shards on two workers
    [victim] = [w for w in citus_cluster.workers if w.port == next(iter(placed))]
    [spared] = [w for w in citus_cluster.workers if w is not victim]
    lost, kept = placed[victim.port][0], placed[spared.port][0]
    executed = ledger.count()

    if failure == "killed":
        victim.kill9()
    else:
        victim.pause()
    try:
        assert await post(client, lost, "during") == 503
        assert await post(client, lost, f"setup-{lost}") == 503  # a replay needs its shard too
        assert ledger.count() == executed, "nothing forwarded for the lost owner"
        assert await post(client, kept, "during") == 201
        assert await post(client, kept, "during") == 201  # its replay
        assert ledger.count("during") == 1
    finally:
        if failure == "killed":
            victim.start()
        else:
            victim.resume()

    deadline = time.monotonic() + RECOVERY_SECONDS
    while (status := await post(client, lost, "after")) != 201:
        assert status == 503 and time.monotonic() < deadline, status
    assert await post(client, lost, f"setup-{lost}") == 201  # replayed from its shard again
    assert ledger.count("during") == 1 and ledger.count("after") == 1
