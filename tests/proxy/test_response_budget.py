"""limits.response_buffer and limits.max_connections: what many concurrent clients may make one
proxy process hold (docs/operations.md, Memory), and that nothing changes for the clients."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from idemproxy.proxy.context import CONTEXT
from tests.support.proxyapp import ProxyClient
from tests.support.proxychecks import KEY, REPLAYED, eventually

from .conftest import ProxyFactory

KiB = 1024
SIZE = 512 * KiB
CONCURRENT = 24
BUDGET = 2 * 1024 * KiB  # a sixth of what the responses hold together
EXECUTIONS = web.AppKey("executions", list[int])
ARRIVED = web.AppKey("arrived", asyncio.Event)


def body_for(number: int, size: int = SIZE) -> bytes:
    return bytes((i * 7 + number) % 256 for i in range(256)) * (size // 256)


async def _answer_all_at_once(request: web.Request) -> web.StreamResponse:
    """Waits until every request of the test arrived, then answers them all: CONCURRENT
    responses of SIZE bytes are in flight in the proxy at the same time."""
    number = int(request.match_info["number"])
    executions: list[int] = request.app[EXECUTIONS]
    executions.append(number)
    if len(executions) >= CONCURRENT:
        request.app[ARRIVED].set()
    await request.app[ARRIVED].wait()
    size = int(request.query.get("size", SIZE))
    response = web.StreamResponse(headers={"X-Number": str(number)})
    if "chunked" in request.query:
        response.enable_chunked_encoding()
    else:
        response.content_length = size
    await response.prepare(request)
    body = body_for(number, size)
    for start in range(0, size, 64 * KiB):
        await response.write(body[start : start + 64 * KiB])
    await response.write_eof()
    return response


@pytest.fixture
async def upstream() -> AsyncIterator[TestServer]:
    app = web.Application()
    app[EXECUTIONS] = []
    app[ARRIVED] = asyncio.Event()
    app.router.add_post("/big/{number}", _answer_all_at_once)
    server = TestServer(app)
    async with server:
        yield server


class GaugeWatch:
    """The proxy's idemproxy_response_buffer_bytes gauge, read every millisecond."""

    def __init__(self, client: ProxyClient) -> None:
        self._registry = client.app[CONTEXT].metrics.registry
        self.peak = 0.0
        self._task: asyncio.Task[None] | None = None

    def value(self) -> float:
        value = self._registry.get_sample_value("idemproxy_response_buffer_bytes")
        assert value is not None
        return value

    async def _watch(self) -> None:
        while True:
            self.peak = max(self.peak, self.value())
            await asyncio.sleep(0.001)

    async def __aenter__(self) -> GaugeWatch:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def _post(client: TestClient[Any, Any], number: int, query: str) -> tuple[int, bytes, str]:
    async with client.post(f"/big/{number}{query}", data=b"{}", headers={KEY: f"k{number}"}) as r:
        return r.status, await r.read(), r.headers.get(REPLAYED, "")


@pytest.mark.parametrize("budget", [BUDGET, 0], ids=["budget", "everything-on-disk"])
@pytest.mark.parametrize("query", ["", "?chunked=1"], ids=["content-length", "chunked"])
async def test_concurrent_large_responses_stay_within_the_budget_and_are_stored_whole(
    proxy: ProxyFactory, upstream: TestServer, budget: int, query: str
) -> None:
    client = await proxy(
        upstream=str(upstream.make_url("")).rstrip("/"),
        max_stored_body=SIZE,
        # Room is waited for, not overdrawn after the default second (overdrafts have tests of
        # their own): a store write a loaded machine slows must not read as a budget broken.
        limits={"response_buffer": budget, "response_buffer_wait": 60.0},
    )
    async with GaugeWatch(client) as gauge:
        answers = await asyncio.gather(*(_post(client, n, query) for n in range(CONCURRENT)))
    assert [status for status, _, _ in answers] == [200] * CONCURRENT
    assert [body == body_for(n) for n, (_, body, _) in enumerate(answers)] == [True] * CONCURRENT
    assert [replayed for _, _, replayed in answers] == [""] * CONCURRENT
    # Held for real (a large first answer counts until written), but never over the budget; with
    # no budget, one body at a time is let through for its store write.
    assert 0 < gauge.peak <= max(budget, SIZE)
    assert gauge.value() == 0  # every byte given back
    # Every one of them was stored, and is replayed byte for byte without another execution.
    replays = await asyncio.gather(*(_post(client, n, query) for n in range(CONCURRENT)))
    assert [(status, replayed) for status, _, replayed in replays] == [(200, "true")] * CONCURRENT
    assert [body == body_for(n) for n, (_, body, _) in enumerate(replays)] == [True] * CONCURRENT
    executions: list[int] = upstream.app[EXECUTIONS]
    assert sorted(executions) == list(range(CONCURRENT))
    assert gauge.value() == 0


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET /x HTTP/1.1\r\nHost: proxy\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return head


async def test_connections_over_the_limit_wait_until_one_closes(proxy: ProxyFactory) -> None:
    client = await proxy(limits={"max_connections": 2})
    registry = client.app[CONTEXT].metrics.registry
    held = [await asyncio.open_connection(client.host, client.port) for _ in range(2)]
    for reader, writer in held:
        assert (await _get(reader, writer)).startswith(b"HTTP/1.1 201")
    assert registry.get_sample_value("idemproxy_client_connections") == 2
    # The third connects (the kernel's backlog takes it) but is not served while two are open.
    reader, writer = await asyncio.open_connection(client.host, client.port)
    waiting = asyncio.create_task(_get(reader, writer))
    done, _ = await asyncio.wait([waiting], timeout=0.5)
    assert not done
    assert registry.get_sample_value("idemproxy_client_connections") == 2
    held[0][1].close()
    head = await asyncio.wait_for(waiting, timeout=3)
    assert head.startswith(b"HTTP/1.1 201")
    assert registry.get_sample_value("idemproxy_client_connections") == 2
    for _, open_writer in (held[1], (reader, writer)):
        open_writer.close()


async def _slow_reader(client: TestClient[Any, Any]) -> tuple[Any, Any]:
    """A connection whose client reads nothing until told: its answer waits in the proxy."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (client.host, client.port))
    return await asyncio.open_connection(sock=sock)


@pytest.mark.parametrize("budget", [None, 0], ids=["in-memory", "on-disk"])
async def test_concurrent_replays_of_one_large_job_share_one_copy_of_its_body(
    proxy: ProxyFactory, upstream: TestServer, budget: int | None
) -> None:
    # Larger than the kernel's socket buffers take (4 MiB at most): the replays are still being
    # written while their clients read nothing.
    size = 8 * 1024 * KiB
    limits = {} if budget is None else {"response_buffer": budget}
    client = await proxy(
        upstream=str(upstream.make_url("")).rstrip("/"), max_stored_body=size, limits=limits
    )
    upstream.app[ARRIVED].set()  # answer at once
    assert (await _post(client, 3, f"?size={size}"))[:2] == (200, body_for(3, size))
    registry = client.app[CONTEXT].metrics.registry
    request = (
        f"POST /big/3?size={size} HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: k3\r\n"
        "Content-Type: application/octet-stream\r\nContent-Length: 2\r\n\r\n{}"
    ).encode()
    connections = [await _slow_reader(client) for _ in range(8)]
    for _, writer in connections:
        writer.write(request)
    try:
        # Every replay is being written, and they hold the body once between them, counted in
        # the budget; without room in it, each is answered from a temporary file instead.
        held = size if budget is None else 0
        if held:  # waited for: a loaded machine starts the replays later than at once
            await eventually(
                lambda: registry.get_sample_value("idemproxy_replay_body_bytes") == held
            )
        await asyncio.sleep(0.3)
        assert registry.get_sample_value("idemproxy_replay_body_bytes") == held
        assert registry.get_sample_value("idemproxy_response_buffer_bytes") == held
        for reader, _ in connections:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            assert b"\r\nIdempotent-Replayed: true\r\n" in head
            body = await asyncio.wait_for(reader.readexactly(size), timeout=5)
            assert body == body_for(3, size)
    finally:
        for _, writer in connections:
            writer.close()
    await asyncio.sleep(0.05)
    assert registry.get_sample_value("idemproxy_replay_body_bytes") == 0
    assert registry.get_sample_value("idemproxy_response_buffer_bytes") == 0
    assert upstream.app[EXECUTIONS] == [3]
