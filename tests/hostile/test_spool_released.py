"""A spooled request body (over `server.spool_threshold`) is a temporary file held open until
its request is done with it: given back at once when its attempt ends, whatever the outcome,
not when the cyclic garbage collector next runs (which the proxy makes rare: `gc.freeze()` and a
high threshold). An `unknown` attempt's failure held its frames, the request's among them, in a
reference cycle with the upstream exchange: every such upload kept its file open."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import os
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.support.proxyapp import ProxyFactory

BODY = b"x" * (3 * 1024 * 1024)  # over the 1 MiB spool threshold


def _deleted_files() -> int:
    """Open descriptors of this process on files no longer linked (the spools)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)"):
                count += 1
    return count


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _reset_after_a_partial_head(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Reads the request's head, sends half a response head and resets: `unknown`."""
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Len")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        writer.close()


@pytest.fixture
async def resetting() -> AsyncIterator[str]:
    server = await asyncio.start_server(_reset_after_a_partial_head, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_an_unknown_attempt_gives_its_spooled_body_back_at_once(
    make_proxy: ProxyFactory, sqlite_dsn: str, resetting: str, no_collector: None
) -> None:
    client: TestClient[Any, Any] = await make_proxy(store=sqlite_dsn, upstream=resetting)
    before = _deleted_files()
    for number in range(3):
        headers = {"Idempotency-Key": f"spooled-{number}"}
        upload = io.BytesIO(BODY)  # aiohttp warns that bytes this large go in one write
        async with client.post("/upload", data=upload, headers=headers) as response:
            assert response.status == 502, await response.text()
    await asyncio.sleep(0.2)  # the attempts' tasks end after their answers
    assert _deleted_files() == before
