"""SPEC §3.4: a 2xx that breaks the group's contract proves the upstream acted.

Such an answer is never a release and never a fail-over: the job is `unknown` at once, the first
client gets `502 contract-violation`, every retry `409 outcome-unknown`, and the upstreams'
own records (each `NamedUpstream` counts what it executed) show one execution per key however
often the client retries: on a primary alone, on a primary with fallbacks and under hedging.
A second attempt starts only after an outcome that proves nothing executed, so the hedge timer
brings in no further upstream once a racer may have executed either, and a request cut off
after it was written (a reset, a pooled connection closed under it) never fails over.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from idemproxy.core.types import AttemptState, JobState
from idemproxy.store.base import Store
from tests.support.named_upstream import WRONG_SHAPE
from tests.support.proxychecks import assert_problem, only_job

from .conftest import ProxyFactory
from .test_groups import (
    StartUpstream,
    attempts_settle,
    contract_route,
    eligible,
    send,
    start_upstream,
    states,
)

__all__ = ["start_upstream"]  # the fixture, shared with the other group tests
S = AttemptState
TRIES = 3
# Passes the contract checks' samples, breaks the contract on the real request.
IN_SHAPE: dict[str, Any] = {"id": "s", "choices": [{"text": "sample"}]}


async def tries_until_unknown(client: Any, key: str) -> None:
    """The first answer names the breach; every retry is told the outcome is unknown."""
    async with send(client, key) as response:
        problem = await assert_problem(response, "contract-violation", 502)
        assert b"forty-two" not in await response.read()  # the breaching body is never passed on
        assert "executed" in problem["detail"]
    for _ in range(TRIES - 1):
        async with send(client, key) as response:
            await assert_problem(response, "outcome-unknown", 409)


async def test_a_breach_on_the_only_upstream_makes_the_job_unknown_and_never_runs_again(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=201, document=WRONG_SHAPE)
    client = await proxy(routes=contract_route(tmp_path, primary.url, []))

    await tries_until_unknown(client, "breach")
    assert primary.count("breach") == 1
    job = await only_job(jobs)
    assert (job.state, job.response) == (JobState.UNKNOWN, None)
    assert states(job) == [(1, primary.url, S.UNKNOWN)]
    attempt = job.attempts[0]
    assert attempt.status == 201
    assert attempt.error is not None and attempt.error.startswith("contract: ")
    assert "choices" in attempt.error  # names what the answer broke


async def test_a_breach_of_the_primary_never_fails_over(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=201, document=WRONG_SHAPE)
    fallback = await start_upstream(
        "fallback", status=201, document=WRONG_SHAPE, sample_document=IN_SHAPE
    )
    client = await proxy(routes=contract_route(tmp_path, primary.url, [fallback.url]))
    assert eligible(client) == (fallback.url,)

    await tries_until_unknown(client, "no-fail-over")
    assert (primary.count("no-fail-over"), fallback.count("no-fail-over")) == (1, 0)
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert states(job) == [(1, primary.url, S.UNKNOWN)]


async def test_a_breach_of_the_fallback_after_a_release_makes_the_job_unknown(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=503)  # proves nothing executed: fail over
    fallback = await start_upstream(
        "fallback", status=201, document=WRONG_SHAPE, sample_document=IN_SHAPE
    )
    client = await proxy(routes=contract_route(tmp_path, primary.url, [fallback.url]))

    await tries_until_unknown(client, "late-breach")
    assert (primary.count("late-breach"), fallback.count("late-breach")) == (1, 1)
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert states(job) == [(1, primary.url, S.FAILED), (2, fallback.url, S.UNKNOWN)]


async def test_a_body_too_large_to_check_is_unknown_not_released(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=201, raw=b"x" * 4096)
    fallback = await start_upstream("fallback", sample_document=IN_SHAPE)
    routes = contract_route(tmp_path, primary.url, [fallback.url])
    client = await proxy(routes=routes, max_stored_body=1024)

    await tries_until_unknown(client, "too-large")
    assert (primary.count("too-large"), fallback.count("too-large")) == (1, 0)
    job = await only_job(jobs)
    assert states(job) == [(1, primary.url, S.UNKNOWN)]
    assert job.attempts[0].error == "contract: body too large to check against the contract"


async def test_a_hedged_primary_breaching_before_the_hedge_starts_no_other_upstream(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    primary = await start_upstream("primary", status=201, document=WRONG_SHAPE)
    fallback = await start_upstream("fallback", sample_document=IN_SHAPE)
    routes = contract_route(tmp_path, primary.url, [fallback.url])
    routes[0]["hedge_after"] = 0.3
    client = await proxy(routes=routes)
    assert eligible(client) == (fallback.url,)

    await tries_until_unknown(client, "hedged-breach")
    assert (primary.count("hedged-breach"), fallback.count("hedged-breach")) == (1, 0)
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert states(job) == [(1, primary.url, S.UNKNOWN)]


async def test_hedged_racers_that_both_breach_leave_the_job_unknown(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, tmp_path: Path
) -> None:
    # The hedge starts before any answer (hedging's one exception, docs/attempts.md); once both
    # racers broke the contract no retry executes anything more.
    primary = await start_upstream("primary", status=201, delay=0.4, document=WRONG_SHAPE)
    fallback = await start_upstream(
        "fallback", status=201, document=WRONG_SHAPE, sample_document=IN_SHAPE
    )
    routes = contract_route(tmp_path, primary.url, [fallback.url])
    routes[0]["hedge_after"] = 0.1
    client = await proxy(routes=routes)

    await tries_until_unknown(client, "both-breach")
    assert (primary.count("both-breach"), fallback.count("both-breach")) == (1, 1)
    job = await attempts_settle(jobs, (await only_job(jobs)).id)
    assert job.state is JobState.UNKNOWN
    assert states(job) == [(1, primary.url, S.UNKNOWN), (2, fallback.url, S.UNKNOWN)]


async def test_the_hedge_timer_brings_in_no_upstream_after_a_racer_may_have_executed(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store
) -> None:
    primary = await start_upstream("primary", delay=0.6)
    first = await start_upstream("first", status=504)  # may have executed: unknown
    second = await start_upstream("second")
    route = {
        "prefix": "/v1",
        "upstream": primary.url,
        "fallbacks": [first.url, second.url],
        "hedge_after": 0.15,
    }
    client = await proxy(routes=[route])

    async with send(client, "timer") as response:
        assert response.status == 200
        assert (await response.json())["upstream"] == "primary"
    assert (first.count("timer"), second.count("timer")) == (1, 0)
    job = await attempts_settle(jobs, (await only_job(jobs)).id)
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 1)
    assert states(job) == [(1, primary.url, S.SUCCEEDED), (2, first.url, S.UNKNOWN)]


# --- transport failures once a request byte may have reached the primary --------------------


class CuttingUpstream:
    """A raw primary: answers the first request on a connection with a keep-alive 200, then, as
    `cut` says, reads the next request in full and resets the connection ("reset") or closes it
    without a word ("close", an idle timeout firing at the wrong moment)."""

    def __init__(self, cut: str) -> None:
        self.cut = cut
        self.keys: list[bytes] = []
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await self._request(reader):
                self.keys += [line for line in head.split(b"\r\n") if line.startswith(KEY_LINE)]
                if len(self.keys) > 1:
                    if self.cut == "reset":
                        writer.transport.abort()
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        finally:
            writer.close()

    @staticmethod
    async def _request(reader: asyncio.StreamReader) -> bytes:
        with contextlib.suppress(asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    await reader.readexactly(int(line.split(b":")[1]))
            return head
        return b""


KEY_LINE = b"Idempotency-Key: "


@pytest.mark.parametrize("cut", ["reset", "close"])
async def test_a_request_cut_off_on_a_pooled_connection_never_fails_over(
    proxy: ProxyFactory, start_upstream: StartUpstream, jobs: Store, cut: str
) -> None:
    primary = CuttingUpstream(cut)
    server = await asyncio.start_server(primary.handle, "127.0.0.1", 0)
    primary.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    fallback = await start_upstream("fallback")
    client = await proxy(
        routes=[{"prefix": "/v1", "upstream": primary.url, "fallbacks": [fallback.url]}]
    )
    try:
        async with send(client, "warm") as response:
            assert response.status == 200  # the connection is pooled now
        for _ in range(TRIES):
            async with send(client, "cut") as response:
                code = response.headers.get("Idempotency-Error")
                assert code in ("upstream-unavailable", "outcome-unknown")
        # The request reached the primary in full: unknown, never the fallback, never again.
        assert primary.keys == [KEY_LINE + b"warm", KEY_LINE + b"cut"]
        assert fallback.count("cut") == 0
        job = await jobs.get("anonymous", "cut")
        assert job is not None and job.state is JobState.UNKNOWN
    finally:
        server.close()
        await server.wait_closed()
