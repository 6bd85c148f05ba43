"""SPEC §3.2: what each upstream result does to the job, and what the next request gets."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from idemproxy.core.types import AttemptState, JobState
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.ports import free_port
from tests.support.proxychecks import (
    ATTEMPT,
    JOB,
    KEY,
    REPLAYED,
    assert_problem,
    closed_port,
    eventually,
    only_job,
    settle_quietly,
)

from .conftest import ProxyFactory, RawUpstream


async def test_upstream_timeout_is_504_then_outcome_unknown_without_forwarding(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(upstream_timeout=0.15)
    request: dict[str, Any] = {"data": b"charge", "headers": {KEY: "slow"}}
    async with client.post("/charge?delay=0.4", **request) as first:
        await assert_problem(first, "upstream-timeout", 504, retry="never", job_state="unknown")
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert [a.state for a in job.attempts] == [AttemptState.UNKNOWN]

    await eventually(lambda: ledger.count("slow") == 1)  # it did execute: that is why "unknown"
    async with client.post("/charge?delay=0.4", **request) as retry:
        await assert_problem(retry, "outcome-unknown", 409, retry="never", job_state="unknown")
    await settle_quietly()
    assert ledger.count("slow") == 1
    after = await only_job(jobs)
    assert (after.state, after.attempt_count, after.version) == (
        JobState.UNKNOWN,
        1,
        job.version,
    )


@pytest.mark.parametrize("status", [408, 425, 429, 503])
async def test_release_status_is_passed_on_and_a_retry_is_attempt_two(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store, status: int
) -> None:
    client = await proxy()
    url = f"/charge?status={status}"
    for attempt in (1, 2):
        async with client.post(url, data=b"charge", headers={KEY: "busy"}) as response:
            assert response.status == status  # the upstream's own answer, not a problem
            assert "Idempotency-Error" not in response.headers
            assert REPLAYED not in response.headers
            assert json.loads(await response.read())["execution"] == attempt
        job = await only_job(jobs)
        assert job.state is JobState.RELEASED
        assert job.attempt_count == attempt

    assert ledger.count("busy") == 2
    first, second = ledger.executions
    assert (first.header(ATTEMPT), second.header(ATTEMPT)) == ("1", "2")
    assert first.header(JOB) == second.header(JOB) == job.id
    assert [a.state for a in job.attempts] == [AttemptState.FAILED, AttemptState.FAILED]
    assert [a.status for a in job.attempts] == [status, status]


async def test_released_job_completes_on_a_later_attempt_and_is_replayed(
    make_proxy: ProxyFactory, store_dsn: str, ledger: Ledger, jobs: Store
) -> None:
    # The first proxy's upstream refuses connections (nothing sent: released); a restart with
    # the real upstream runs the next attempt.
    down = await make_proxy(store=store_dsn, upstream=f"http://127.0.0.1:{free_port()}")
    async with down.post("/charge", data=b"charge", headers={KEY: "later"}) as response:
        assert response.status == 502
    assert (await only_job(jobs)).state is JobState.RELEASED
    client = await make_proxy(store=store_dsn)
    async with client.post("/charge", data=b"charge", headers={KEY: "later"}) as response:
        assert response.status == 201
        assert REPLAYED not in response.headers
        body = await response.read()
    async with client.post("/charge", data=b"charge", headers={KEY: "later"}) as response:
        assert response.headers[REPLAYED] == "true"
        assert await response.read() == body
    job = await only_job(jobs)
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 2)
    assert [a.state for a in job.attempts] == [AttemptState.FAILED, AttemptState.SUCCEEDED]
    assert ledger.count("later") == 1


@pytest.mark.parametrize("status", [502, 504])
async def test_gateway_error_status_makes_the_job_unknown(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store, status: int
) -> None:
    client = await proxy()
    url = f"/charge?status={status}"
    async with client.post(url, data=b"charge", headers={KEY: "gw"}) as first:
        assert first.status == status
        assert "Idempotency-Error" not in first.headers  # the upstream's answer is passed on
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert [a.state for a in job.attempts] == [AttemptState.UNKNOWN]

    async with client.post(url, data=b"charge", headers={KEY: "gw"}) as retry:
        await assert_problem(retry, "outcome-unknown", 409, retry="never", job_state="unknown")
    assert ledger.count("gw") == 1


async def test_connection_refused_is_502_and_releases_the_job(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    client = await proxy(routes=[{"prefix": "/dead", "upstream": dead}])
    for attempt in (1, 2):
        async with client.post("/dead/charge", data=b"x", headers={KEY: "refused"}) as response:
            await assert_problem(
                response, "upstream-unavailable", 502, retry="same-key", job_state="released"
            )
        job = await only_job(jobs)
        assert (job.state, job.attempt_count) == (JobState.RELEASED, attempt)
    assert [a.state for a in job.attempts] == [AttemptState.FAILED] * 2
    assert all(a.upstream == dead for a in job.attempts)
    assert ledger.count() == 0


async def test_server_error_500_is_a_completed_job_and_replayed(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy()
    async with client.post("/charge?status=500", data=b"x", headers={KEY: "boom"}) as first:
        assert first.status == 500
        body = await first.read()
    async with client.post("/charge?status=500", data=b"x", headers={KEY: "boom"}) as second:
        assert second.status == 500
        assert second.headers[REPLAYED] == "true"
        assert await second.read() == body
    assert ledger.count("boom") == 1
    assert (await only_job(jobs)).state is JobState.COMPLETED


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten.", id="cut-off"),
        pytest.param(b"HTTP/1.1 ???\r\n\r\n", id="malformed"),
        pytest.param(b"", id="closed-without-answer"),
    ],
)
async def test_broken_response_after_the_request_was_sent_makes_the_job_unknown(
    proxy: ProxyFactory, raw_upstream: RawUpstream, jobs: Store, answer: bytes
) -> None:
    raw_upstream.response = answer
    client = await proxy(upstream=raw_upstream.url)
    async with client.post("/charge", data=b"x", headers={KEY: "broken"}) as first:
        await assert_problem(first, "upstream-unavailable", 502)
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    async with client.post("/charge", data=b"x", headers={KEY: "broken"}) as retry:
        await assert_problem(retry, "outcome-unknown", 409, retry="never", job_state="unknown")
    assert len(raw_upstream.heads) == 1


async def test_large_body_cut_off_mid_stream_aborts_the_client_and_makes_the_job_unknown(
    proxy: ProxyFactory, raw_upstream: RawUpstream, jobs: Store
) -> None:
    raw_upstream.response = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 5000
    client = await proxy(upstream=raw_upstream.url, max_stored_body=1000)
    async with client.post("/charge", data=b"x", headers={KEY: "cut"}) as first:
        assert first.status == 200  # the status line was out before the body broke
        with pytest.raises(aiohttp.ClientPayloadError):
            await first.read()  # the client must see that the body is incomplete
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    async with client.post("/charge", data=b"x", headers={KEY: "cut"}) as retry:
        await assert_problem(retry, "outcome-unknown", 409, retry="never", job_state="unknown")
    assert len(raw_upstream.heads) == 1
