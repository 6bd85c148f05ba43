"""SPEC §8: from the start of a graceful shutdown, responses still being finished carry
`Connection: close`. A streamed response (an event stream, SPEC §2 step 4) whose head goes out
after SIGTERM is sent without it, although the connection is closed after it: a client that
pipelines its next request on the connection learns only by the close.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from .conftest import StartProxy

pytestmark = pytest.mark.slow


@pytest.fixture
async def late_stream_backend() -> AsyncIterator[str]:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(1.0)  # the head comes after the drain began
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(b"data: %d\n\n" % i)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    "key_header",
    [b"Idempotency-Key: late-head\r\n", b""],
    ids=["governed", "pass-through"],
)
async def test_a_stream_answered_during_a_drain_says_connection_close(
    start_proxy: StartProxy, late_stream_backend: str, tmp_path: Path, key_header: bytes
) -> None:
    proxy = await start_proxy(
        "--upstream", late_stream_backend, "--store", f"sqlite:///{tmp_path / 'jobs.db'}"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(
        b"POST /events HTTP/1.1\r\nHost: p\r\n" + key_header + b"Content-Length: 0\r\n\r\n"
    )
    await writer.drain()
    await asyncio.sleep(0.3)
    os.kill(proxy.pid, signal.SIGTERM)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 200")
    assert b"\r\nconnection: close\r\n" in head.lower(), head
