"""SPEC §3.1, §11: expired jobs are forgotten; the sweeper never deletes in_flight or unknown."""

from __future__ import annotations

import asyncio

from idemproxy.core.types import JobState
from idemproxy.proxy.background.sweeper import sweep_once
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxychecks import JOB, KEY, REPLAYED, wait_for_jobs

from .conftest import ProxyFactory


async def test_expired_completed_job_is_forgotten_and_the_key_executes_again(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(ttl=0.3)
    job_ids = []
    for replayed in (None, "true"):
        async with client.post("/payments", data=b"pay", headers={KEY: "ttl"}) as response:
            assert response.headers.get(REPLAYED) == replayed
            job_ids.append(response.headers[JOB])
    await asyncio.sleep(0.35)
    async with client.post("/payments", data=b"pay", headers={KEY: "ttl"}) as response:
        assert response.status == 201
        assert REPLAYED not in response.headers
        job_ids.append(response.headers[JOB])

    assert ledger.count("ttl") == 2
    assert job_ids[0] == job_ids[1] != job_ids[2]
    [job] = await jobs.list_jobs()
    assert (job.id, job.state) == (job_ids[2], JobState.COMPLETED)


async def test_sweeper_deletes_expired_terminal_jobs_but_never_in_flight_or_unknown(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(ttl=0.2)

    async def post(key: str, query: str = "") -> int:
        async with client.post(f"/p{query}", data=b"x", headers={KEY: key}) as response:
            await response.read()
            return response.status

    assert await post("done-1") == 201
    assert await post("done-2") == 201
    assert await post("released", "?status=503") == 503
    assert await post("unknown", "?status=502") == 502
    slow = asyncio.create_task(post("in-flight", "?delay=0.6"))
    await wait_for_jobs(jobs, 5)
    await asyncio.sleep(0.25)  # everything above has expired by now; "in-flight" is still running
    assert {j.key: j.state for j in await jobs.list_jobs()}["in-flight"] is JobState.IN_FLIGHT

    assert await sweep_once(jobs, batch_size=1) == 3  # one small batch at a time

    left = {j.key: j.state for j in await jobs.list_jobs()}
    assert left == {"unknown": JobState.UNKNOWN, "in-flight": JobState.IN_FLIGHT}
    assert await slow == 201
    assert {j.key: j.state for j in await jobs.list_jobs()}["in-flight"] is JobState.COMPLETED
    assert ledger.count() == 5


async def test_the_longest_ttl_is_stored_and_replayed_on_every_store(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store, backend_url: str
) -> None:
    """SPEC §12: a duration is at most ten years, and that one works: its expiry fits every
    store's timestamps (a longer one is refused at start-up, tests/unit/test_units.py)."""
    client = await proxy(
        ttl="3650d", routes=[{"prefix": "/", "upstream": backend_url, "ttl": "3650d"}]
    )
    for replayed in (None, "true"):
        async with client.post("/payments", data=b"pay", headers={KEY: "long"}) as response:
            assert response.status == 201, await response.text()
            assert response.headers.get(REPLAYED) == replayed
    assert ledger.count("long") == 1
    [job] = await jobs.list_jobs()
    assert job.state == JobState.COMPLETED
