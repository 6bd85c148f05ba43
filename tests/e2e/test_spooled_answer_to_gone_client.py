"""SPEC §9: what a client can make the proxy hold is bounded. A governed body that does not fit
the response budget waits in an unnamed temporary file (proxy/server/capture.py) and its client is
answered from there (SpooledResponse). When that client hung up before its answer, the answer
is never written, `write_eof` never runs, and the file (its descriptor and its disk space)
stays open until a full garbage collection happens to reach it: each client that leaves early
adds one.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from .conftest import StartProxy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

CLIENTS = 30
SIZE = 100_000


@pytest.fixture
async def slow_backend() -> AsyncIterator[str]:
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.5)
        return web.Response(body=b"x" * SIZE)

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


def _deleted_files(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").endswith("(deleted)"):
                count += 1
        except OSError:
            pass
    return count


async def test_a_client_gone_before_its_spooled_answer_leaves_no_open_file(
    start_proxy: StartProxy, slow_backend: str, tmp_path: Path
) -> None:
    proxy = await start_proxy(
        "--upstream",
        slow_backend,
        "--store",
        f"sqlite:///{tmp_path / 'jobs.db'}",
        env={"IDEMPROXY_LIMITS__RESPONSE_BUFFER": "0"},  # every body waits on disk
    )
    before = _deleted_files(proxy.pid)
    writers = []
    for i in range(CLIENTS):
        _reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(
            f"POST /r HTTP/1.1\r\nHost: p\r\nIdempotency-Key: gone-{i}\r\n"
            "Content-Length: 0\r\n\r\n".encode()
        )
        await writer.drain()
        writers.append(writer)
    await asyncio.sleep(0.2)
    for writer in writers:
        writer.close()
    await asyncio.sleep(2.0)  # the upstream answered, every job completed
    assert _deleted_files(proxy.pid) - before == 0
