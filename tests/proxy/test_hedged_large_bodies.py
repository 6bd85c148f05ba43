"""SPEC §3.4, §7: a hedged racer whose body is too large to keep completes the job before its
head goes out; one that loses that CAS drops what it captured, and gives its bytes back to the
response budget (docs/operations.md, Memory)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from idemproxy.core.types import AttemptState, JobState
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from tests.support.proxychecks import KEY, eventually, only_job

from .conftest import ProxyFactory

KiB = 1024
LIMIT = 64 * KiB  # max_stored_body: each racer's body is larger, and streams through
SIZE = 256 * KiB
Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


def chunked(delay: float, fill: bytes) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(delay)
        response = web.StreamResponse()
        response.enable_chunked_encoding()  # no length: the proxy captures up to the limit
        await response.prepare(request)
        for _ in range(SIZE // (16 * KiB)):
            await response.write(fill * (16 * KiB))
        await response.write_eof()
        return response

    return answer


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[str, str]]:
    servers = []
    for delay, fill in ((0.4, b"p"), (0.0, b"f")):  # a slow primary, a fast hedge
        app = web.Application()
        app.router.add_post("/big", chunked(delay, fill))
        servers.append(TestServer(app))
    async with servers[0], servers[1]:
        yield str(servers[0].make_url("")), str(servers[1].make_url(""))


async def test_a_racer_that_loses_the_completion_gives_back_what_it_captured(
    proxy: ProxyFactory, upstreams: tuple[str, str]
) -> None:
    primary, fallback = upstreams
    client = await proxy(
        upstream=primary, fallbacks=[fallback], hedge_after=0.1, max_stored_body=LIMIT
    )
    budget = client.app[CONTEXT].budget

    async with client.post("/big", data=b"{}", headers={KEY: "large-race"}) as response:
        assert response.status == 200
        assert await response.read() == b"f" * SIZE  # the hedge won

    # The primary answers later, captures LIMIT bytes and more, and loses the CAS.
    await eventually(lambda: not client.app[CONTEXT].attempts, timeout=10)
    assert budget.used == 0


def declared_then_stalled(sent: int, stall: float, *, cut: bool) -> Answer:
    """A head that declares SIZE bytes, `sent` of them, then a stall; then the connection is
    closed (`cut`) or the rest follows."""

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse()
        response.content_length = SIZE
        await response.prepare(request)
        await response.write(b"p" * sent)
        await asyncio.sleep(stall)
        if cut:
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write(b"p" * (SIZE - sent))
        await response.write_eof()
        return response

    return answer


def whole(fill: bytes) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(body=fill * SIZE)

    return answer


@pytest.mark.parametrize("cut", [True, False], ids=["cut-off", "stalled"])
async def test_a_declared_large_body_wins_the_race_only_once_more_than_the_limit_arrived(
    proxy: ProxyFactory, jobs: Store, cut: bool
) -> None:
    """docs/attempts.md, Hedging: a head that declares a large body wins nothing by itself. A
    primary that sends its head and a few bytes, then stalls, is hedged, and the hedge's whole
    answer wins; the primary's was the client's answer before, cut off with it (and a retry
    got an empty `omitted` replay of a job that was `completed`)."""
    servers = []
    for handler in (declared_then_stalled(500, 1.0, cut=cut), whole(b"f")):
        app = web.Application()
        app.router.add_post("/big", handler)
        servers.append(TestServer(app))
    async with servers[0], servers[1]:
        primary, fallback = (str(server.make_url("")) for server in servers)
        client = await proxy(
            upstream=primary, fallbacks=[fallback], hedge_after=0.2, max_stored_body=LIMIT
        )
        headers = {KEY: f"declared-{cut}"}
        async with client.post("/big", data=b"{}", headers=headers) as response:
            assert response.status == 200
            assert await response.read() == b"f" * SIZE  # the hedge won
        await eventually(lambda: not client.app[CONTEXT].attempts, timeout=10)
        async with client.post("/big", data=b"{}", headers=headers) as replay:
            assert replay.status == 200
            assert replay.headers.get("Idempotent-Replayed") == "true"
            assert replay.headers.get("Idempotency-Replay") == "omitted"  # too large to keep
        assert client.app[CONTEXT].budget.used == 0
    job = await only_job(jobs)
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 2)
    first, second = job.attempts
    # Cut off: it may have executed, and lost; stalled: it lost the completion when it ended.
    assert first.state == (AttemptState.UNKNOWN if cut else AttemptState.DISCARDED), first
    assert second.state == AttemptState.SUCCEEDED
