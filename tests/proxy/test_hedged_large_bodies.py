"""SPEC §3.4, §7: a hedged racer whose body is too large to keep completes the job before its
head goes out; one that loses that CAS drops what it captured, and gives its bytes back to the
response budget (docs/operations.md, Memory)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from idemproxy.proxy.context import CONTEXT
from tests.support.proxychecks import KEY, eventually

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
