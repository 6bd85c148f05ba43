"""SPEC §2.3, §8: a duplicate that arrives while the first request is in flight."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp.test_utils import TestClient
from multidict import CIMultiDict

from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxychecks import (
    JOB,
    KEY,
    REPLAYED,
    assert_problem,
    eventually,
    only_job,
    wait_for_jobs,
)

from .conftest import ProxyFactory

SLOW = "/payments?delay=0.5"
REQUEST: dict[str, Any] = {"data": b"pay", "headers": {KEY: "held"}}


async def _answer(client: TestClient[Any, Any]) -> tuple[int, bytes, CIMultiDict[str]]:
    async with client.post(SLOW, **REQUEST) as response:
        return response.status, await response.read(), response.headers.copy()


async def _first_in_flight(client: TestClient[Any, Any], jobs: Store) -> asyncio.Task[Any]:
    first = asyncio.create_task(_answer(client))
    await wait_for_jobs(jobs)
    return first


async def test_duplicate_in_flight_waits_and_gets_the_stored_response(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy()
    first = await _first_in_flight(client, jobs)
    status, body, headers = await _answer(client)
    first_status, first_body, first_headers = await first

    assert status == first_status == 201
    assert body == first_body
    assert headers[REPLAYED] == "true"
    assert REPLAYED not in first_headers
    assert headers[JOB] == first_headers[JOB]
    assert ledger.count("held") == 1


async def test_duplicate_waiting_past_max_wait_gets_request_in_flight(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(max_wait=0.05)
    first = await _first_in_flight(client, jobs)
    async with client.post(SLOW, **REQUEST) as duplicate:
        await assert_problem(duplicate, "request-in-flight", 409)
        assert int(duplicate.headers["Retry-After"]) >= 1
    assert not first.done()
    assert (await first)[0] == 201
    assert ledger.count("held") == 1
    async with client.post(SLOW, **REQUEST) as later:  # once done, the duplicate replays
        assert later.headers[REPLAYED] == "true"


async def test_ietf_profile_answers_a_duplicate_in_flight_at_once(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(profile="ietf")
    first = await _first_in_flight(client, jobs)
    started = time.monotonic()
    async with client.post(SLOW, **REQUEST) as duplicate:
        await assert_problem(duplicate, "request-in-flight", 409)
        assert duplicate.headers["Retry-After"]
    assert time.monotonic() - started < 0.3  # not held until the first one finished
    assert not first.done()
    assert (await first)[0] == 201
    await eventually(lambda: ledger.count("held") == 1)
    assert (await only_job(jobs)).attempt_count == 1


async def test_held_duplicates_of_a_released_job_run_one_attempt_at_a_time(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy()

    async def post() -> int:
        async with client.post("/pay?status=503&delay=0.15", **REQUEST) as response:
            await response.read()
            return response.status

    first = asyncio.create_task(post())
    await wait_for_jobs(jobs)  # the others arrive once the first has claimed the key
    statuses = await asyncio.gather(first, *(post() for _ in range(3)))

    assert statuses == [503] * 4  # every client gets the upstream's own answer
    job = await only_job(jobs)
    # Each retry of the released job won the CAS alone: attempts never overlapped or repeated.
    assert [e.header("Idempotency-Attempt") for e in ledger.executions] == ["1", "2", "3", "4"]
    assert {e.header(JOB) for e in ledger.executions} == {job.id}
    assert job.attempt_count == 4
