"""A response whose body is still on its way reaches the client as it arrives: its head is not
held back until the body is whole, as long as nothing has to be stored first (SPEC §2.5, §7)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from idemproxy.store.base import Store
from idemproxy.types import JobState

from .conftest import ProxyFactory
from .support import only_job, wait_for_state

PIECE_SECONDS = 0.7  # the body's three bytes take 2.1 s


class TrickleUpstream:
    """Sends its head at once, then a 3-byte body one byte every PIECE_SECONDS."""

    def __init__(self) -> None:
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    await reader.readexactly(int(value))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n")
            await writer.drain()
            for byte in b"abc":
                await asyncio.sleep(PIECE_SECONDS)
                writer.write(bytes([byte]))
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@pytest.fixture
async def trickle() -> AsyncIterator[TrickleUpstream]:
    upstream = TrickleUpstream()
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        server.close()
        await server.wait_closed()


async def _timed(client: TestClient[Any, Any], request: bytes) -> tuple[float, float, bytes]:
    """Seconds until the response head arrived and until its body did; the body."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        started = time.monotonic()
        writer.write(request)
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
        head_at = time.monotonic() - started
        body = await asyncio.wait_for(reader.readexactly(3), timeout=5)
        return head_at, time.monotonic() - started, body
    finally:
        writer.close()
        await writer.wait_closed()


async def test_pass_through_sends_the_head_before_a_small_body_has_arrived(
    proxy: ProxyFactory, trickle: TrickleUpstream
) -> None:
    client = await proxy(upstream=trickle.url)
    request = b"GET /slow HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n"
    head_at, body_at, body = await _timed(client, request)
    assert body == b"abc"
    assert head_at < 0.5, f"the head took {head_at:.2f}s"
    assert body_at > 2 * PIECE_SECONDS


async def test_governed_answer_declared_over_max_stored_body_does_not_wait_for_it(
    proxy: ProxyFactory, trickle: TrickleUpstream, jobs: Store
) -> None:
    # SPEC §7: a body over max_stored_body is not kept, so nothing needs to be read first.
    client = await proxy(upstream=trickle.url, max_stored_body=2)
    request = (
        b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: t1\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    head_at, body_at, body = await _timed(client, request)
    assert body == b"abc"
    assert head_at < 0.5, f"the head took {head_at:.2f}s"
    assert body_at > 2 * PIECE_SECONDS
    # Completed once the body is through, which the client may see first.
    job = await wait_for_state(jobs, (await only_job(jobs)).id, JobState.COMPLETED)
    assert job.response is not None and job.response.omitted
