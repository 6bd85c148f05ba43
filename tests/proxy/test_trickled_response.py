"""A response whose body is still on its way reaches the client as it arrives: its head is not
held back until the body is whole, as long as nothing has to be stored first (SPEC §2.5, §7)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from idemproxy.core.types import JobState, StoredResponse
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from tests.support.proxychecks import KEY, REPLAYED, only_job, wait_for_state

from .conftest import ProxyFactory

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


EVENTS = [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n"]
EVENT_SECONDS = 0.6
SSE_EXECUTIONS = web.AppKey("sse_executions", list)


async def _events(request: web.Request) -> web.StreamResponse:
    await request.read()
    request.app[SSE_EXECUTIONS].append(request.headers.get("Idempotency-Key"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in EVENTS:
        await response.write(event)
        await asyncio.sleep(EVENT_SECONDS)
    await response.write_eof()
    return response


@pytest.fixture
async def event_stream() -> AsyncIterator[TestServer]:
    app = web.Application()
    app[SSE_EXECUTIONS] = []
    app.router.add_post("/{tail:.*}", _events)
    server = TestServer(app)
    async with server:
        yield server


async def test_governed_event_stream_reaches_its_client_as_it_arrives_and_is_stored(
    proxy: ProxyFactory, event_stream: TestServer, jobs: Store
) -> None:
    # SPEC §2 step 4: a stream is sent while it is captured, and stored once it has ended.
    client = await proxy(upstream=str(event_stream.make_url("")).rstrip("/"))
    started = time.monotonic()
    async with client.post("/chat", data=b"{}", headers={KEY: "s1"}) as response:
        assert response.status == 200
        first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), timeout=5)
        first_at = time.monotonic() - started
        rest = await response.read()
    assert first == EVENTS[0]
    assert first_at < EVENT_SECONDS, f"the first event took {first_at:.2f}s"
    assert first + rest == b"".join(EVENTS)
    job = await wait_for_state(jobs, (await only_job(jobs)).id, JobState.COMPLETED)
    assert isinstance(job.response, StoredResponse) and job.response.body == b"".join(EVENTS)
    async with client.post("/chat", data=b"{}", headers={KEY: "s1"}) as replay:
        assert replay.headers[REPLAYED] == "true"
        assert await replay.read() == b"".join(EVENTS)
    assert event_stream.app[SSE_EXECUTIONS] == ["s1"]


async def test_governed_event_stream_over_max_stored_body_streams_whole_and_is_kept_omitted(
    proxy: ProxyFactory, event_stream: TestServer, jobs: Store
) -> None:
    client = await proxy(upstream=str(event_stream.make_url("")).rstrip("/"), max_stored_body=20)
    async with client.post("/chat", data=b"{}", headers={KEY: "s2"}) as response:
        assert await response.read() == b"".join(EVENTS)
    job = await wait_for_state(jobs, (await only_job(jobs)).id, JobState.COMPLETED)
    assert job.response is not None and job.response.omitted
    async with client.post("/chat", data=b"{}", headers={KEY: "s2"}) as replay:
        assert replay.headers["Idempotency-Replay"] == "omitted"
        assert await replay.read() == b""
    assert client.app[CONTEXT].budget.used == 0
    assert event_stream.app[SSE_EXECUTIONS] == ["s2"]
