"""Quotas per owner (SPEC §9), on both stores: beyond a limit a new key is `429 quota-exceeded`
with Retry-After, before anything is claimed or forwarded; duplicates and replays never are."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idemproxy.core.types import JobState
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxychecks import KEY, REPLAYED, assert_problem

from .conftest import ProxyFactory

ALICE = {"Authorization": "Bearer alice"}
BOB = {"Authorization": "Bearer bob"}


def _refusals(client: Any, limit: str) -> float:
    registry = client.server.app[CONTEXT].metrics.registry
    value = registry.get_sample_value("idemproxy_quota_refusals_total", {"limit": limit})
    return float(value or 0.0)


async def _post(client: Any, key: str, path: str = "/pay", owner: dict[str, str] = ALICE) -> Any:
    return client.post(path, data=b'{"amount": 1}', headers={KEY: key, **owner})


async def test_in_flight_cap_refuses_a_new_key_and_never_a_duplicate(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(quotas={"max_in_flight": 1})
    slow = asyncio.create_task(
        client.post("/pay?delay=1.0", data=b"x", headers={KEY: "a", **ALICE})
    )
    for _ in range(200):  # the backend records an execution once its delay is over
        if [job.key for job in await jobs.list_jobs(state=JobState.IN_FLIGHT)] == ["a"]:
            break
        await asyncio.sleep(0.01)

    async with await _post(client, "b") as refused:
        problem = await assert_problem(
            refused, "quota-exceeded", 429, retry="same-key", job_state="none"
        )
        assert refused.headers["Retry-After"] == "1"
    assert "in flight" in problem["detail"]
    assert ledger.count("b") == 0  # never forwarded
    assert [job.key for job in await jobs.list_jobs()] == ["a"]  # nothing claimed
    assert _refusals(client, "in_flight") == 1

    async with await _post(client, "x", owner=BOB) as bobs:  # another owner has its own cap
        assert bobs.status == 201
    # A duplicate of the job in flight is held and answered, not refused.
    async with client.post("/pay?delay=1.0", data=b"x", headers={KEY: "a", **ALICE}) as dup:
        assert dup.status == 201 and dup.headers[REPLAYED] == "true"
    async with await slow as first:
        assert first.status == 201
    async with await _post(client, "b") as later:  # the slot is free: the same key now runs
        assert later.status == 201 and REPLAYED not in later.headers
    assert ledger.count("a") == ledger.count("b") == 1


async def test_new_jobs_per_second_are_capped_and_replays_are_not(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(quotas={"max_new_per_second": 2})
    for key in ("r1", "r2"):
        async with await _post(client, key) as response:
            assert response.status == 201
    async with await _post(client, "r3") as refused:
        await assert_problem(refused, "quota-exceeded", 429, retry="same-key", job_state="none")
    for _ in range(3):
        async with await _post(client, "r1") as replay:
            assert replay.status == 201 and replay.headers[REPLAYED] == "true"
    assert ledger.count("r3") == 0 and len(await jobs.list_jobs()) == 2
    assert _refusals(client, "new_per_second") == 1
    await asyncio.sleep(1.2)  # the window has moved on
    async with await _post(client, "r3") as later:
        assert later.status == 201


async def test_stored_bytes_cap_refuses_new_keys_once_full(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(quotas={"max_stored_bytes": "64B"})
    async with await _post(client, "s1") as first:  # the backend's echo is over 64 bytes
        assert first.status == 201 and len(await first.read()) > 64
    async with await _post(client, "s2") as refused:
        problem = await assert_problem(refused, "quota-exceeded", 429, retry="same-key")
        assert refused.headers["Retry-After"] == "60"
    assert "stored responses" in problem["detail"]
    async with await _post(client, "s1") as replay:
        assert replay.status == 201 and replay.headers[REPLAYED] == "true"
    async with await _post(client, "s2", owner=BOB) as bobs:
        assert bobs.status == 201
    assert ledger.count("s2") == 1 and len(await jobs.list_jobs()) == 2
    assert _refusals(client, "stored_bytes") == 1


@pytest.mark.parametrize("quotas", [{}, {"max_in_flight": 0}, {"max_new_per_second": -1}])
async def test_quota_settings(proxy: ProxyFactory, quotas: dict[str, int]) -> None:
    if not quotas:
        client: Any = await proxy()
        assert client.server.app[CONTEXT].quotas is None  # no quota: claims stay one statement
        return
    with pytest.raises(ValueError, match="quotas"):
        await proxy(quotas=quotas)


@pytest.mark.postgres
async def test_replays_under_a_quota_come_from_the_in_process_cache(
    make_proxy: ProxyFactory, pg_dsn: str, ledger: Ledger
) -> None:
    """A duplicate is looked up as a claim would look it up (the replay cache first), so a
    quota costs replays nothing beyond what they cost without one."""
    client: Any = await make_proxy(store=pg_dsn, quotas={"max_in_flight": 5})
    async with await _post(client, "c1") as first:
        assert first.status == 201
    cache = client.server.app[CONTEXT].store
    for _ in range(3):
        async with await _post(client, "c1") as replay:
            assert replay.headers[REPLAYED] == "true"
    registry = client.server.app[CONTEXT].metrics.registry
    hits = registry.get_sample_value("idemproxy_replay_cache_hits_total")
    assert hits is not None and hits >= 2, (hits, type(cache).__name__)
    assert ledger.count("c1") == 1


async def test_a_refused_reclaim_of_an_expired_key_names_no_job(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    """SPEC §8: the expired job is forgotten before the claim afresh is refused, so the problem
    is about no job (`none`, no instance), not the job that is gone."""
    client = await proxy(ttl=0.3, quotas={"max_in_flight": 1})
    async with await _post(client, "old") as first:
        assert first.status == 201
    await asyncio.sleep(0.5)  # the completed job expires
    slow = asyncio.create_task(
        client.post("/pay?delay=1.0", data=b"x", headers={KEY: "a", **ALICE})
    )
    for _ in range(200):
        if [job.key for job in await jobs.list_jobs(state=JobState.IN_FLIGHT)] == ["a"]:
            break
        await asyncio.sleep(0.01)

    async with await _post(client, "old") as refused:
        problem = await assert_problem(
            refused, "quota-exceeded", 429, retry="same-key", job_state="none"
        )
    assert "instance" not in problem
    async with await slow as done:
        assert done.status == 201
    assert ledger.count("old") == 1
