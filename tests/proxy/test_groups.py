"""SPEC §3.4: upstream groups. Fail-over to ordered fallbacks, hedging, contract-gated fallbacks.

Every upstream of a group is a `NamedUpstream` of its own (tests/support/named_upstream.py), so
that the primary and the fallbacks behave differently and each one's executions are counted
apart. All tests run on SQLite and PostgreSQL (`proxy` and `jobs` follow `store_dsn`).
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from idemproxy.core.types import AttemptState, Job, JobState, StoredResponse
from idemproxy.proxy.context import CONTEXT
from idemproxy.proxy.jobs.jobrun import KeptLease
from idemproxy.store.base import Store
from tests.support.named_upstream import WRONG_SHAPE, NamedUpstream, write_contract
from tests.support.proxyapp import ProxyClient
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

from .conftest import ProxyFactory, Server

StartUpstream = Callable[..., Awaitable[NamedUpstream]]
PROMPT: dict[str, Any] = {"model": "m", "prompt": "What is an idempotency key?"}
S = AttemptState


@pytest.fixture
async def start_upstream() -> AsyncIterator[StartUpstream]:
    """`await start_upstream("a", status=…, delay=…)`: a NamedUpstream on an ephemeral port."""
    servers: list[Server] = []

    async def start(name: str, **behaviour: Any) -> NamedUpstream:
        upstream = NamedUpstream(name, **behaviour)
        server = Server(upstream.app())  # keeps executing when the proxy hangs up
        await server.start_server()
        servers.append(server)
        upstream.url = f"http://{server.host}:{server.port}"
        return upstream

    try:
        yield start
    finally:
        for server in servers:
            await server.close()


def send(client: TestClient[Any, Any], key: str) -> Any:
    """The response context manager, for `assert_problem`."""
    return client.post("/v1/chat", json=PROMPT, headers={KEY: key})


async def post(client: TestClient[Any, Any], key: str) -> Answer:
    async with send(client, key) as response:
        return Answer(response.status, dict(response.headers), await response.read())


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def replayed(self) -> bool:
        return self.headers.get(REPLAYED) == "true"


def states(job: Job) -> list[tuple[int, str, AttemptState]]:
    return [(a.number, a.upstream, a.state) for a in job.attempts]


async def attempts_settle(jobs: Store, job_id: str, timeout: float = 5.0) -> Job:
    """The job once no attempt of it is `started` any more (a losing racer has finished)."""
    deadline = time.monotonic() + timeout
    while True:
        job = await jobs.get_by_id(job_id)
        assert job is not None
        if all(a.state is not S.STARTED for a in job.attempts):
            return job
        assert time.monotonic() < deadline, f"attempts still started: {states(job)}"
        await settle_quietly(0.02)


def dead_url() -> str:
    return f"http://127.0.0.1:{closed_port()}"


# --- fail-over in order --------------------------------------------------------------------


async def test_connect_refused_fails_over_to_the_fallback_under_the_same_job(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = dead_url()
    fallback = await start_upstream("fallback")
    client = await proxy(upstream=primary, fallbacks=[fallback.url])

    answer = await post(client, "refused")
    assert answer.status == 200, answer.body
    assert answer.json["upstream"] == "fallback"
    assert "Idempotency-Error" not in answer.headers
    job = await only_job(jobs)
    assert answer.headers[JOB] == job.id
    assert (job.state, job.completed_by, job.attempt_count) == (JobState.COMPLETED, 2, 2)
    first, second = job.attempts
    assert (first.number, first.upstream, first.state) == (1, primary, S.FAILED)
    assert first.error is not None and first.error.startswith("connect failed"), first.error
    assert first.status is None
    assert (second.number, second.upstream, second.state) == (2, fallback.url, S.SUCCEEDED)
    assert second.status == 200
    # One execution in total, carrying the same job and its own attempt number (SPEC §10).
    assert fallback.count() == 1
    [execution] = fallback.received
    assert (execution.header(JOB), execution.header(ATTEMPT)) == (job.id, "2")

    retry = await post(client, "refused")
    assert (retry.status, retry.body, retry.replayed) == (200, answer.body, True)
    assert fallback.count() == 1


@pytest.mark.parametrize("status", [503, 429])
async def test_release_status_of_the_primary_fails_over(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, status: int
) -> None:
    primary = await start_upstream("primary", status=status)
    fallback = await start_upstream("fallback")
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url])

    answer = await post(client, "busy")
    assert (answer.status, answer.json["upstream"]) == (200, "fallback")
    job = await only_job(jobs)
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 2)
    assert states(job) == [(1, primary.url, S.FAILED), (2, fallback.url, S.SUCCEEDED)]
    assert [a.status for a in job.attempts] == [status, 200]
    assert isinstance(job.response, StoredResponse) and job.response.body == answer.body
    assert (primary.count("busy"), fallback.count("busy")) == (1, 1)
    assert [e.header(ATTEMPT) for e in primary.received + fallback.received] == ["1", "2"]


async def test_fail_over_walks_the_fallbacks_in_order(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", status=503)
    second = dead_url()
    third = await start_upstream("third")
    client = await proxy(upstream=primary.url, fallbacks=[second, third.url])

    answer = await post(client, "chain")
    assert answer.json["upstream"] == "third"
    job = await only_job(jobs)
    assert states(job) == [
        (1, primary.url, S.FAILED),
        (2, second, S.FAILED),
        (3, third.url, S.SUCCEEDED),
    ]
    assert job.completed_by == 3


@pytest.mark.parametrize("status", [504, 502])
async def test_unknown_status_of_the_primary_never_fails_over(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, status: int
) -> None:
    primary = await start_upstream("primary", status=status)
    fallback = await start_upstream("fallback")
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url])

    answer = await post(client, "maybe")
    # The primary's own answer reaches the client (SPEC §3.2), not a problem of the proxy's.
    assert (answer.status, answer.json["upstream"]) == (status, "primary")
    assert "Idempotency-Error" not in answer.headers
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert states(job) == [(1, primary.url, S.UNKNOWN)]
    assert fallback.count() == 0

    async with send(client, "maybe") as retry:
        await assert_problem(retry, "outcome-unknown", 409)
    await settle_quietly()
    assert (primary.count(), fallback.count()) == (1, 0)


async def test_timeout_of_the_primary_never_fails_over(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", delay=0.6)
    fallback = await start_upstream("fallback")
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url], upstream_timeout=0.2)

    async with send(client, "slow") as first:
        await assert_problem(first, "upstream-timeout", 504)
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert states(job) == [(1, primary.url, S.UNKNOWN)]
    await eventually(lambda: len(primary.finished) == 1)  # it did execute: hence unknown
    async with send(client, "slow") as retry:
        await assert_problem(retry, "outcome-unknown", 409)
    assert fallback.count() == 0


async def test_release_status_of_the_last_upstream_is_passed_on_and_releases_the_job(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", status=503)
    fallback = await start_upstream("fallback", status=429)
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url])

    answer = await post(client, "all-busy")
    # The last upstream's own response, as without a group (SPEC §3.2).
    assert (answer.status, answer.json["upstream"]) == (429, "fallback")
    assert "Idempotency-Error" not in answer.headers
    assert not answer.replayed
    job = await only_job(jobs)
    assert job.state is JobState.RELEASED
    assert states(job) == [(1, primary.url, S.FAILED), (2, fallback.url, S.FAILED)]
    assert [a.status for a in job.attempts] == [503, 429]


async def test_a_retry_of_a_released_job_starts_again_at_the_primary(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", status=503)
    fallback = await start_upstream("fallback", status=503)
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url])
    assert (await post(client, "again")).status == 503
    assert (await only_job(jobs)).state is JobState.RELEASED

    primary.status = 200  # the primary recovered
    retry = await post(client, "again")
    assert (retry.status, retry.json["upstream"], retry.replayed) == (200, "primary", False)
    job = await only_job(jobs)
    assert (job.state, job.completed_by, job.attempt_count) == (JobState.COMPLETED, 3, 3)
    assert states(job) == [
        (1, primary.url, S.FAILED),
        (2, fallback.url, S.FAILED),
        (3, primary.url, S.SUCCEEDED),
    ]
    assert (primary.count("again"), fallback.count("again")) == (2, 1)
    assert [e.header(ATTEMPT) for e in primary.received] == ["1", "3"]


async def test_a_retry_of_a_released_job_fails_over_again(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", status=503)
    fallback = await start_upstream("fallback", status=503)
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url])
    assert (await post(client, "round")).status == 503

    fallback.status = 200
    retry = await post(client, "round")
    assert (retry.status, retry.json["upstream"]) == (200, "fallback")
    job = await only_job(jobs)
    assert [a.upstream for a in job.attempts] == [primary.url, fallback.url] * 2
    assert job.completed_by == 4


# --- hedging -------------------------------------------------------------------------------


async def test_hedge_on_a_slow_primary_the_first_to_finish_wins(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", delay=0.8)
    fallback = await start_upstream("fallback", delay=0.05)
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url], hedge_after=0.15)

    began = time.monotonic()
    answer = await post(client, "hedged")
    took = time.monotonic() - began
    assert (answer.status, answer.json["upstream"]) == (200, "fallback")
    assert took < 0.7, f"the client waited for the slow primary: {took:.2f}s"
    assert primary.count("hedged") == 1  # the primary got it too: both attempts execute
    assert [e.header(ATTEMPT) for e in fallback.received] == ["2"]

    early = await post(client, "hedged")  # while the primary is still running
    assert (early.status, early.body, early.replayed) == (200, answer.body, True)

    await eventually(lambda: len(primary.finished) == 1)
    job = await attempts_settle(jobs, answer.headers[JOB])
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 2)
    assert states(job) == [(1, primary.url, S.DISCARDED), (2, fallback.url, S.SUCCEEDED)]
    assert job.attempts[0].status == 200  # the late result is recorded, never stored
    assert isinstance(job.response, StoredResponse) and job.response.body == answer.body

    late = await post(client, "hedged")
    assert (late.status, late.body, late.replayed) == (200, answer.body, True)
    assert (primary.count("hedged"), fallback.count("hedged")) == (1, 1)


async def test_hedging_when_the_primary_answers_fast_starts_no_second_attempt(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary")
    fallback = await start_upstream("fallback")
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url], hedge_after=0.2)

    answer = await post(client, "fast")
    assert answer.json["upstream"] == "primary"
    await settle_quietly(0.3)  # past hedge_after
    job = await only_job(jobs)
    assert states(job) == [(1, primary.url, S.SUCCEEDED)]
    assert (job.completed_by, fallback.count()) == (1, 0)


async def test_a_failing_hedge_leaves_the_primary_to_win(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", delay=0.4)
    hedge = dead_url()
    client = await proxy(upstream=primary.url, fallbacks=[hedge], hedge_after=0.1)

    answer = await post(client, "hedge-down")
    assert (answer.status, answer.json["upstream"]) == (200, "primary")
    job = await only_job(jobs)
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 1)
    assert states(job) == [(1, primary.url, S.SUCCEEDED), (2, hedge, S.FAILED)]
    assert job.attempts[1].error is not None
    assert job.attempts[1].error.startswith("connect failed")


async def test_a_primary_released_fast_under_hedging_fails_over_at_once(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", status=503)
    fallback = await start_upstream("fallback")
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url], hedge_after=5)

    began = time.monotonic()
    answer = await post(client, "hedge-503")
    assert answer.json["upstream"] == "fallback"
    assert time.monotonic() - began < 2, "waited for hedge_after instead of failing over"
    job = await only_job(jobs)
    assert states(job) == [(1, primary.url, S.FAILED), (2, fallback.url, S.SUCCEEDED)]


async def test_all_racers_released_releases_the_job(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", status=503, delay=0.3)
    fallback = await start_upstream("fallback", status=503)
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url], hedge_after=0.1)

    answer = await post(client, "all-fail")
    assert answer.status >= 500
    job = await only_job(jobs)
    assert job.state is JobState.RELEASED
    assert states(job) == [(1, primary.url, S.FAILED), (2, fallback.url, S.FAILED)]
    assert [a.status for a in job.attempts] == [503, 503]
    assert (primary.count(), fallback.count()) == (1, 1)

    primary.delay, primary.status = 0.0, 200  # released: the next retry runs again
    retry = await post(client, "all-fail")
    assert (retry.status, retry.json["upstream"]) == (200, "primary")


async def test_a_race_whose_job_was_taken_over_answers_as_the_job_is_now(
    proxy: ProxyFactory,
    start_upstream: StartUpstream,
    jobs: Store,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SPEC §3.5: every racer released, but its lease ran out first (a process stalled past it)
    and another request took the job over as `unknown`: the settle loses its CAS, and the
    client is told what a retry will be told (`409 outcome-unknown`), as after a fail-over that
    lost its CAS; it got the last racer's own `503` (retryable) before."""
    monkeypatch.setattr(KeptLease, "_start_renewing", lambda _self: None)  # a stalled process
    primary = await start_upstream("primary", status=503, delay=1.5)
    fallback = await start_upstream("fallback", status=503, delay=1.4)
    client = await proxy(
        upstream=primary.url,
        fallbacks=[fallback.url],
        hedge_after=0.1,
        lease=1.0,
        pool={"store_timeout": 0.5},
    )

    first = asyncio.create_task(post(client, "taken-over"))
    for _ in range(250):  # both racers started (hedge_after)
        job = await jobs.get("anonymous", "taken-over")
        if job is not None and job.attempt_count == 2:
            break
        await asyncio.sleep(0.02)
    assert job is not None and job.attempt_count == 2
    await asyncio.sleep(1.1)  # the lease ran out by the database clock
    assert await jobs.take_over(job)
    answer = await first
    assert (answer.status, answer.headers.get("Idempotency-Error")) == (409, "outcome-unknown")
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    async with send(client, "taken-over") as retry:
        await assert_problem(retry, "outcome-unknown", 409)
    assert (primary.count(), fallback.count()) == (1, 1)


async def test_all_racers_failed_with_one_unknown_makes_the_job_unknown(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", delay=1.0)  # times out: may have executed
    fallback = await start_upstream("fallback", status=503)
    client = await proxy(
        upstream=primary.url, fallbacks=[fallback.url], hedge_after=0.1, upstream_timeout=0.4
    )

    async with send(client, "one-unknown") as first:
        await assert_problem(first, "upstream-timeout", 504)
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert states(job) == [(1, primary.url, S.UNKNOWN), (2, fallback.url, S.FAILED)]
    async with send(client, "one-unknown") as retry:
        await assert_problem(retry, "outcome-unknown", 409)
    assert (primary.count(), fallback.count()) == (1, 1)


@pytest.mark.parametrize("outcome", ["failed", "unknown"])
async def test_a_losing_racer_that_fails_after_the_winner_is_recorded(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, outcome: str
) -> None:
    # The primary answers 503 (failed), or times out (unknown), after the hedge has won.
    delay, timeout = (0.5, 5.0) if outcome == "failed" else (2.0, 0.6)
    primary = await start_upstream("primary", status=503, delay=delay)
    fallback = await start_upstream("fallback")
    client = await proxy(
        upstream=primary.url, fallbacks=[fallback.url], hedge_after=0.1, upstream_timeout=timeout
    )

    answer = await post(client, "late-failure")
    assert answer.json["upstream"] == "fallback"
    job = await attempts_settle(jobs, answer.headers[JOB])
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 2)
    assert states(job) == [(1, primary.url, S(outcome)), (2, fallback.url, S.SUCCEEDED)]
    assert isinstance(job.response, StoredResponse) and job.response.body == answer.body


async def test_an_unknown_status_under_hedging_never_fails_over(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    # SPEC §3.4: "An unknown outcome never fails over" -- hedging only adds an attempt when
    # nothing answered within hedge_after; a 504 is an answer.
    primary = await start_upstream("primary", status=504)
    fallback = await start_upstream("fallback")
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url], hedge_after=1.0)

    answer = await post(client, "hedge-504")
    assert answer.status in (502, 504)
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert states(job) == [(1, primary.url, S.UNKNOWN)]
    assert fallback.count() == 0


@pytest.mark.parametrize("status", [503, 504])
async def test_the_last_racers_own_response_reaches_the_client(
    proxy: ProxyFactory, start_upstream: StartUpstream, status: int
) -> None:
    primary = await start_upstream("primary", status=status, delay=0.3)
    fallback = await start_upstream("fallback", status=503)
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url], hedge_after=0.1)

    answer = await post(client, "own-answer")
    assert (answer.status, answer.json["upstream"]) == (status, "primary")
    assert "Idempotency-Error" not in answer.headers


async def test_hedging_brings_in_one_more_upstream_per_hedge_after(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    # The third answers at about 0.35 s; the first two not before 2 s, a margin a loaded CI
    # machine needs for the third to start in time.
    first = await start_upstream("first", delay=2.0)
    second = await start_upstream("second", delay=2.0)
    third = await start_upstream("third", delay=0.05)
    client = await proxy(upstream=first.url, fallbacks=[second.url, third.url], hedge_after=0.15)

    answer = await post(client, "cascade")
    assert answer.json["upstream"] == "third"
    assert (first.count(), second.count(), third.count()) == (1, 1, 1)
    await eventually(lambda: len(first.finished) == len(second.finished) == 1)
    job = await attempts_settle(jobs, answer.headers[JOB])
    assert states(job) == [
        (1, first.url, S.DISCARDED),
        (2, second.url, S.DISCARDED),
        (3, third.url, S.SUCCEEDED),
    ]
    assert job.completed_by == 3


async def test_a_large_response_under_hedging_reaches_the_client(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", raw=b"x" * 5000)
    fallback = await start_upstream("fallback")
    client = await proxy(
        upstream=primary.url, fallbacks=[fallback.url], hedge_after=1.0, max_stored_body=1000
    )
    answer = await post(client, "large")
    assert (answer.status, answer.body) == (200, b"x" * 5000)
    assert fallback.count() == 0
    job = await only_job(jobs)
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 1)


@pytest.mark.parametrize("size", [300 * 1024, 2 * 1024 * 1024 + 768], ids=["300K", "2M"])
@pytest.mark.parametrize("hedged", [False, True], ids=["fail-over", "hedged"])
async def test_every_attempt_of_a_group_sends_the_same_request_body(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, hedged: bool, size: int
) -> None:
    # 2M: above server.spool_threshold (1 MiB), the body is kept on disk, not in memory; every
    # attempt, racing ones at the same time, re-sends all of it.
    body = (bytes(range(256)) * (size // 256 + 1))[:size]
    primary = await start_upstream("primary", status=503, delay=0.3 if hedged else 0.0)
    fallback = await start_upstream("fallback", delay=0.05)
    hedging: dict[str, Any] = {"hedge_after": 0.1} if hedged else {}
    client = await proxy(upstream=primary.url, fallbacks=[fallback.url], **hedging)

    headers = {KEY: "big-body", "Content-Type": "application/octet-stream"}
    async with client.post("/v1/upload", data=io.BytesIO(body), headers=headers) as response:
        assert response.status == 200
        assert json.loads(await response.read())["upstream"] == "fallback"
    await eventually(lambda: len(primary.finished) == 1)
    assert [len(e.body) for e in primary.received + fallback.received] == [len(body)] * 2
    assert primary.received[0].body == fallback.received[0].body == body
    job = await attempts_settle(jobs, (await only_job(jobs)).id)
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 2)


# --- contract-gated fallbacks --------------------------------------------------------------


def contract_route(
    tmp_path: Path, primary: str, fallbacks: list[str], **contract: Any
) -> list[dict[str, Any]]:
    settings = write_contract(tmp_path) | {"interval": 0} | contract
    return [{"prefix": "/v1", "upstream": primary, "fallbacks": fallbacks, "contract": settings}]


def eligible(client: ProxyClient) -> tuple[str, ...]:
    """The fallbacks of the /v1 group that passed their contract check, as the proxy sees it."""
    assert isinstance(client.server, Server)
    ctx = client.app[CONTEXT]
    route = ctx.routes.find("/v1/chat", None)
    assert route is not None and route.gate is not None
    return route.gate.eligible


async def test_a_fallback_of_the_wrong_shape_is_never_eligible(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=503)
    fallback = await start_upstream("fallback", document=WRONG_SHAPE)
    routes = contract_route(tmp_path, primary.url, [fallback.url])
    client = await proxy(routes=routes)
    assert fallback.samples == 2  # checked at start-up with every sample
    assert eligible(client) == ()

    answer = await post(client, "gated")
    # The primary is the only option: its own 503 reaches the client and releases the job.
    assert (answer.status, answer.json["upstream"]) == (503, "primary")
    job = await only_job(jobs)
    assert job.state is JobState.RELEASED
    assert states(job) == [(1, primary.url, S.FAILED)]
    assert fallback.count("gated") == 0  # never called at run time
    assert fallback.count() == fallback.samples


async def test_a_compliant_fallback_is_eligible_and_takes_over(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=503)
    fallback = await start_upstream("fallback")
    client = await proxy(routes=contract_route(tmp_path, primary.url, [fallback.url]))
    assert eligible(client) == (fallback.url,)
    assert primary.samples == 0  # the start-up check covers the fallbacks only

    answer = await post(client, "takeover")
    assert (answer.status, answer.json["upstream"]) == (200, "fallback")
    job = await only_job(jobs)
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 2)
    assert states(job) == [(1, primary.url, S.FAILED), (2, fallback.url, S.SUCCEEDED)]


async def test_only_the_compliant_fallbacks_of_a_group_are_eligible(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=503)
    wrong = await start_upstream("wrong", document=WRONG_SHAPE)
    down = dead_url()
    right = await start_upstream("right")
    routes = contract_route(tmp_path, primary.url, [wrong.url, down, right.url])
    client = await proxy(routes=routes)
    assert eligible(client) == (right.url,)

    answer = await post(client, "skip")
    assert answer.json["upstream"] == "right"
    job = await only_job(jobs)
    assert states(job) == [(1, primary.url, S.FAILED), (2, right.url, S.SUCCEEDED)]
    assert wrong.count("skip") == 0


async def test_a_fallback_that_starts_complying_becomes_eligible_on_the_next_check(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=503)
    fallback = await start_upstream("fallback", document=WRONG_SHAPE)
    routes = contract_route(tmp_path, primary.url, [fallback.url], interval=0.1)
    client = await proxy(routes=routes)
    assert eligible(client) == ()
    assert (await post(client, "before")).status == 503

    fallback.document = None  # fixed: answers in the contract's shape from now on
    await eventually(lambda: eligible(client) == (fallback.url,))
    answer = await post(client, "after")
    assert (answer.status, answer.json["upstream"]) == (200, "fallback")

    fallback.document = WRONG_SHAPE  # and broken again: no longer eligible
    await eventually(lambda: eligible(client) == ())


async def test_a_response_violating_the_contract_is_never_stored_and_never_run_again(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", document=WRONG_SHAPE)
    client = await proxy(routes=contract_route(tmp_path, primary.url, []))

    async with send(client, "bad-shape") as response:
        await assert_problem(response, "contract-violation", 502)
        assert b"forty-two" not in await response.read()
    job = await only_job(jobs)
    assert (job.state, job.response) == (JobState.UNKNOWN, None)
    failed = job.attempts[-1]
    assert (failed.state, failed.status) == (S.UNKNOWN, 200)
    assert failed.error is not None and failed.error.startswith("contract: ")
    assert "choices" in failed.error
    # SPEC §3.4: the 200 proves the upstream acted; a retry never executes it again.
    primary.document = None
    async with send(client, "bad-shape") as response:
        await assert_problem(response, "outcome-unknown", 409)
    assert primary.count("bad-shape") == 1


async def test_a_primary_violating_the_contract_never_fails_over(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", document=WRONG_SHAPE)
    fallback = await start_upstream("fallback")
    client = await proxy(routes=contract_route(tmp_path, primary.url, [fallback.url]))

    async with send(client, "shape-over") as response:
        await assert_problem(response, "contract-violation", 502)
    job = await only_job(jobs)
    assert states(job) == [(1, primary.url, S.UNKNOWN)]
    assert job.attempts[0].error is not None
    assert job.attempts[0].error.startswith("contract: ")
    assert fallback.count("shape-over") == 0  # SPEC §3.4: a breach never fails over


async def test_a_2xx_body_that_is_not_json_violates_the_contract(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary")
    client = await proxy(routes=contract_route(tmp_path, primary.url, []))
    primary.raw = b"<html>rate limited</html>"
    async with send(client, "not-json") as response:
        await assert_problem(response, "contract-violation", 502)
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert job.attempts[0].error == "contract: body is not JSON"


async def test_a_non_2xx_answer_is_not_checked_against_the_contract(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=400, document=WRONG_SHAPE)
    client = await proxy(routes=contract_route(tmp_path, primary.url, []))
    # Classified as usual (SPEC §3.2): a 400 completes the job and is replayed.
    first = await post(client, "client-error")
    assert (first.status, first.json) == (400, WRONG_SHAPE)
    again = await post(client, "client-error")
    assert (again.status, again.body, again.replayed) == (400, first.body, True)
    assert (await only_job(jobs)).state is JobState.COMPLETED


async def test_a_racer_violating_the_contract_loses_to_a_compliant_one(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    # The fallback passed its samples but breaks the contract on the real request.
    primary = await start_upstream("primary", delay=0.4)
    in_shape = {"id": "s", "choices": [{"text": "sample"}]}
    fallback = await start_upstream("fallback", document=WRONG_SHAPE, sample_document=in_shape)
    routes = contract_route(tmp_path, primary.url, [fallback.url])
    routes[0]["hedge_after"] = 0.1
    client = await proxy(routes=routes)
    assert eligible(client) == (fallback.url,)

    answer = await post(client, "racer-shape")
    assert (answer.status, answer.json["upstream"]) == (200, "primary")
    job = await only_job(jobs)
    assert (job.completed_by, isinstance(job.response, StoredResponse) and job.response.body) == (
        1,
        answer.body,
    )
    assert states(job) == [(1, primary.url, S.SUCCEEDED), (2, fallback.url, S.UNKNOWN)]
    assert (job.attempts[1].error or "").startswith("contract: ")


async def test_a_fallback_answering_the_samples_with_errors_is_not_eligible(
    proxy: ProxyFactory, start_upstream: StartUpstream, tmp_path: Path
) -> None:
    primary = await start_upstream("primary")
    fallback = await start_upstream("fallback", status=404)
    client = await proxy(routes=contract_route(tmp_path, primary.url, [fallback.url]))
    assert eligible(client) == ()
