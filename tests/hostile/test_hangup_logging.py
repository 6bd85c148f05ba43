"""A client hanging up mid-body is routine: one INFO line and a counter, never a traceback.

Before, aiohttp logged "Error handling request" at ERROR with a 25-line traceback for each one:
log flooding for the price of a half-sent request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from idemproxy.observe.metrics import DisconnectStage
from idemproxy.proxy.context import CONTEXT
from tests.support.backend import Ledger
from tests.support.metrics import counted
from tests.support.proxyapp import ProxyFactory

HEADS = {
    "declared-length": b"Content-Length: 1000\r\n\r\n0123456789",
    "chunked": b"Transfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n",
    "spooled": b"Content-Length: 5000000\r\n\r\n" + b"x" * 200_000,
}


@pytest.mark.parametrize("case", HEADS)
async def test_a_hang_up_mid_body_is_one_info_line_and_counted(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    ledger: Ledger,
    caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    client = await make_proxy(store=sqlite_dsn, server={"spool_threshold": 65536})
    metrics = client.app[CONTEXT].metrics
    caplog.set_level(logging.DEBUG)
    for attempt in range(3):
        _, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(
            f"POST /pay HTTP/1.1\r\nHost: p\r\nIdempotency-Key: k{attempt}\r\n".encode()
            + HEADS[case]
        )
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await writer.wait_closed()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while metrics.client_disconnect[DisconnectStage.REQUEST_BODY]._value.get() < 3:
        assert loop.time() < deadline, "the hang-ups were not counted"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    lines = [r for r in caplog.records if "hung up" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO] * 3
    assert counted(metrics.registry, "idemproxy_requests_total", outcome="rejected") == 3
    assert ledger.count() == 0


async def test_a_hang_up_mid_upload_of_a_pass_through_is_the_clients_not_the_upstreams(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    ledger: Ledger,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A chunked pass-through body streams upstream as it arrives: the client hanging up
    mid-upload is its own hang-up (499, counted as one), not an upstream reset that any client
    could add to the upstream's 5xx at will."""
    client = await make_proxy(store=sqlite_dsn)
    metrics = client.app[CONTEXT].metrics
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        _, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /pay HTTP/1.1\r\nHost: p\r\n" + HEADS["chunked"])
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await writer.wait_closed()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while metrics.client_disconnect[DisconnectStage.REQUEST_BODY]._value.get() < 3:
        assert loop.time() < deadline, "the hang-ups were not counted as the client's"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    ours = [r for r in caplog.records if r.name.startswith("idemproxy")]  # not the backend's
    assert not [r for r in ours if r.exc_info or r.levelno >= logging.WARNING]
    assert counted(metrics.registry, "idemproxy_requests_total", status_class="5xx") == 0


async def _slow_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    with contextlib.suppress(ConnectionError):
        for _ in range(100):
            await response.write(b"x" * 65536)
            await asyncio.sleep(0.01)
    return response


async def test_a_hang_up_during_a_pass_through_response_is_one_info_line_and_counted(
    make_proxy: ProxyFactory, sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = web.Application()
    app.router.add_get("/{tail:.*}", _slow_stream)
    upstream = TestServer(app)
    await upstream.start_server()
    try:
        client = await make_proxy(store=sqlite_dsn, upstream=str(upstream.make_url("")))
        metrics = client.app[CONTEXT].metrics
        caplog.set_level(logging.DEBUG)
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"GET /big HTTP/1.1\r\nHost: p\r\n\r\n")
        await writer.drain()
        assert (await reader.read(1000)).startswith(b"HTTP/1.1 200 ")
        writer.transport.abort()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while metrics.client_disconnect[DisconnectStage.RESPONSE]._value.get() < 1:
            assert loop.time() < deadline, "the hang-up was not counted"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
    finally:
        await upstream.close()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert [r.levelno for r in caplog.records if "hung up" in r.getMessage()] == [logging.INFO]
