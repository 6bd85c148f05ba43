"""Deleting a job is a compare-and-swap on the version read, and never makes a request run twice.

On both stores, with a real upstream that counts its executions: a job read `released` that a
retry restarts before the delete lands is not deleted; a job in flight is refused unless forced;
and a forced delete of a running job answers that request `409 outcome-unknown` instead of
claiming the key again inside the same request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp.test_utils import TestClient

from idemproxy.core.types import Job, JobState
from idemproxy.store.base import Store

from .conftest import Upstream, post
from .test_jobs_api import assert_problem, job_with_key

Client = TestClient[Any, Any]
# Long enough for the test to act while the upstream runs, short for the suite.
RUNNING = 0.6


async def in_flight(store: Store, key: str) -> Job:
    """The job under `key` once a request has it in flight (bounded wait)."""
    for _ in range(200):
        listed = [job for job in await store.list_jobs() if job.key == key]
        if listed and listed[0].state is JobState.IN_FLIGHT:
            return listed[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no job in flight under {key}")


async def released_job(proxy: Client, upstream: Upstream, store: Store, key: str) -> Job:
    upstream.script.append(503)  # SPEC §3.2: the upstream says it did not process it
    status, _headers, _body = await post(proxy, key)
    assert status == 503
    job = await job_with_key(store, key)
    assert job.state is JobState.RELEASED
    return job


async def test_a_released_job_restarted_by_a_retry_is_not_deleted_by_its_old_version(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    read = await released_job(proxy, upstream, store, "k-1")  # what the operator saw
    upstream.delays.append(RUNNING)
    retry = asyncio.create_task(post(proxy, "k-1"))
    running = await in_flight(store, "k-1")
    assert running.version > read.version

    # The delete of the version read loses its compare-and-swap: nothing is deleted.
    assert not await store.delete(read)
    assert not await store.delete(read, force=True)
    async with admin.delete(f"/jobs/{read.id}?version={read.version}") as response:
        await assert_problem(response, 409, "version-mismatch")
    async with admin.delete(f"/jobs/{read.id}") as response:
        await assert_problem(response, 409, "job-in-flight")

    status, _headers, body = await retry
    assert (status, json.loads(body)["execution"]) == (201, 2)
    assert upstream.executions == 2  # the 503 and the retry: never a third
    done = await job_with_key(store, "k-1")
    assert (done.id, done.state) == (read.id, JobState.COMPLETED)


async def test_a_forced_delete_of_a_running_job_never_runs_its_request_twice(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    upstream.delays.append(RUNNING)
    first = asyncio.create_task(post(proxy, "k-1"))
    running = await in_flight(store, "k-1")
    async with admin.delete(f"/jobs/{running.id}?force=true") as response:
        assert response.status == 204

    status, headers, body = await first
    assert status == 409, body
    assert headers["Idempotency-Error"] == "outcome-unknown"
    assert "deleted" in json.loads(body)["detail"]
    assert upstream.executions == 1  # the completion found its job gone and did not claim again
    assert await store.get("anonymous", "k-1") is None
    assert [job for job in await store.list_jobs() if job.key == "k-1"] == []

    # What the docs warn of: a retry after the forced delete starts a new job and runs again.
    status, _headers, body = await post(proxy, "k-1")
    assert (status, json.loads(body)["execution"]) == (201, 2)


async def test_a_forced_delete_whose_key_a_retry_claimed_answers_the_first_request_409(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    upstream.delays.extend([RUNNING, 0.0])
    first = asyncio.create_task(post(proxy, "k-1"))
    running = await in_flight(store, "k-1")
    async with admin.delete(f"/jobs/{running.id}?force=true") as response:
        assert response.status == 204
    status, _headers, _body = await post(proxy, "k-1")  # a new job, run to completion
    assert status == 201

    status, headers, _body = await first
    assert (status, headers["Idempotency-Error"]) == (409, "outcome-unknown")
    assert upstream.executions == 2  # the forced-away run and the retry's: not a third
    after = await job_with_key(store, "k-1")
    assert after.id != running.id and after.state is JobState.COMPLETED


async def test_delete_takes_a_version_and_validates_its_flags(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await released_job(proxy, upstream, store, "k-1")
    for query in ("version=x", "version=-1", "force=maybe"):
        async with admin.delete(f"/jobs/{job.id}?{query}") as response:
            await assert_problem(response, 400, "invalid-request")
    async with admin.delete(f"/jobs/{job.id}?version={job.version + 1}") as response:
        await assert_problem(response, 409, "version-mismatch")
    assert await store.get_by_id(job.id) is not None
    async with admin.delete(f"/jobs/{job.id}?version={job.version}") as response:
        assert response.status == 204
    assert await store.get_by_id(job.id) is None
