"""The client-facing fast path (proxy/front.py), over raw sockets.

Plain requests are served without aiohttp's connection loop; anything else is handed, with every
byte not yet served, to aiohttp's handler on the same connection, and must be answered exactly
as with the fast path off (`server.fast_path: false`). A spy on `FrontConnection._hand_off`
tells which way each request went.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from backend import Ledger
from idemproxy.config import load_settings
from idemproxy.proxy import front
from idemproxy.proxy.any_path import AnyPath
from idemproxy.proxy.app import create_app
from idemproxy.proxy.handler import expect_continue
from idemproxy.proxy.listener import GuardedSite

IDLE = 2.0  # how long a test waits for bytes that should come


@dataclass
class Listening:
    runner: web.AppRunner
    port: int

    def connections(self) -> list[Any]:
        assert self.runner.server is not None
        return self.runner.server.connections


Start = Callable[..., Awaitable[Listening]]


@pytest.fixture
async def listen(backend_url: str, sqlite_dsn: str) -> AsyncIterator[Start]:
    """A listener as `idemproxy serve` runs it (server.py), for the proxy or another app."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application | None = None, **overrides: Any) -> Listening:
        settings = load_settings(**{"upstream": backend_url, "store": sqlite_dsn, **overrides})
        runner = web.AppRunner(
            app or create_app(settings),
            access_log=None,
            handler_cancellation=False,
            keepalive_timeout=settings.server.keepalive_timeout,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        runners.append(runner)
        await GuardedSite(runner, "127.0.0.1:0", settings.server).start()
        return Listening(runner, runner.addresses[0][1])

    try:
        yield start
    finally:
        for runner in reversed(runners):
            with contextlib.suppress(asyncio.TimeoutError):
                await runner.cleanup()


@pytest.fixture
def handed_off(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The first bytes of each head handed to aiohttp."""
    seen: list[bytes] = []
    original = front.FrontConnection._hand_off

    def spy(self: front.FrontConnection) -> None:
        seen.append(self._buffer[:40])
        original(self)

    monkeypatch.setattr(front.FrontConnection, "_hand_off", spy)
    return seen


class Client:
    """One raw connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> Client:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self) -> tuple[bytes, bytes]:
        """One response's head (status line and headers) and body of declared length."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), IDLE)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await asyncio.wait_for(self.reader.readexactly(length), IDLE)
        return head, body

    async def everything(self) -> bytes:
        """Whatever comes until the proxy closes the connection (or falls silent)."""
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := await asyncio.wait_for(self.reader.read(65536), IDLE):
                answer += chunk
        return answer

    async def closed(self, within: float = IDLE) -> bool:
        with contextlib.suppress(TimeoutError, ConnectionError):
            return await asyncio.wait_for(self.reader.read(1), within) == b""
        return False

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


@pytest.fixture
async def clients() -> AsyncIterator[Callable[[int], Awaitable[Client]]]:
    opened: list[Client] = []

    async def connect(port: int) -> Client:
        client = await Client.connect(port)
        opened.append(client)
        return client

    try:
        yield connect
    finally:
        for client in opened:
            await client.close()


def post(path: str, key: str | None = None, body: bytes = b"{}", extra: bytes = b"") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
    if key is not None:
        head += f"Idempotency-Key: {key}\r\n"
    head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + extra + b"\r\n" + body


def status(head: bytes) -> int:
    return int(head.split(b" ", 2)[1])


async def test_plain_requests_are_served_on_a_kept_alive_connection(
    listen: Start, clients: Any, handed_off: list[bytes], ledger: Ledger
) -> None:
    proxy = await listen()
    client = await clients(proxy.port)
    await client.send(post("/orders", "front-1"))
    first = await client.response()
    await client.send(post("/orders", "front-1"))
    replay = await client.response()
    await client.send(b"GET /things?x=1 HTTP/1.1\r\nHost: p\r\n\r\n")
    passed = await client.response()
    assert status(first[0]) == 201 and status(replay[0]) == 201
    assert b"Idempotent-Replayed: true" in replay[0] and replay[1] == first[1]
    assert status(passed[0]) == 201 and b'"method": "GET", "path": "/things"' in passed[1]
    assert ledger.count("front-1") == 1
    assert handed_off == []
    assert [type(c) for c in proxy.connections()] == [front.FrontConnection]


# Plain heads with details a parser could get wrong (RFC 9110 §5.5, §5.3; RFC 9112 §3.2).
PLAIN = {
    "trailing-whitespace": b"GET /a HTTP/1.1\r\nHost: p \t\r\nX-Note: v w \t\r\n\r\n",
    "obs-text": b"GET /a HTTP/1.1\r\nHost: p\r\nX-Note: caf\xc3\xa9 \xff\r\n\r\n",
    "query-and-fragment": b"GET /a%2Fb/c?x=1&y=%20#frag HTTP/1.1\r\nHost: p\r\n\r\n",
    "repeated-and-mixed-case": b"GET /a HTTP/1.1\r\nhOsT: p\r\nX-A: 1\r\nx-a: 2\r\n\r\n",
    "empty-value": b"GET /a HTTP/1.1\r\nHost: p\r\nX-Empty:\r\n\r\n",
    "body-with-key": post("/a", "plain-key", b'{"b": 2, "a": 1}'),
}


@pytest.mark.parametrize("case", PLAIN)
async def test_plain_requests_reach_the_upstream_as_through_aiohttp(
    listen: Start, handed_off: list[bytes], case: str
) -> None:
    """What the backend saw (method, target, headers, body) is the same either way."""
    seen = []
    for fast_path in (True, False):
        proxy = await listen(server={"fast_path": fast_path})
        client = await Client.connect(proxy.port)
        try:
            await client.send(PLAIN[case].replace(b"plain-key", f"key-{fast_path}".encode()))
            head, body = await client.response()
        finally:
            await client.close()
        assert status(head) == 201, head
        echoed = json.loads(body)
        del echoed["execution"]
        echoed["headers"] = [
            (name, value)
            for name, value in echoed["headers"]
            if name not in ("Idempotency-Key", "Idempotency-Job")
        ]
        seen.append(echoed)
    assert seen[0] == seen[1]
    assert handed_off == []


# Requests that are not plain, each as aiohttp's own handler must see it.
NOT_PLAIN = {
    "http-1.0": b"GET /a HTTP/1.0\r\nHost: p\r\n\r\n",
    "absolute-form": b"GET http://p/a HTTP/1.1\r\nHost: p\r\n\r\n",
    "chunked": b"POST /a HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"1\r\nx\r\n0\r\n\r\n",
    "expect": b"POST /a HTTP/1.1\r\nHost: p\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx",
    "upgrade": b"GET /a HTTP/1.1\r\nHost: p\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    "two-hosts": b"GET /a HTTP/1.1\r\nHost: p\r\nHost: q\r\n\r\n",
    "two-lengths": b"POST /a HTTP/1.1\r\nHost: p\r\nContent-Length: 1\r\n"
    + b"Content-Length: 1\r\n\r\nx",
    "no-host": b"GET /a HTTP/1.1\r\n\r\n",
    "bare-lf": b"GET /a HTTP/1.1\nHost: p\n\n",
    "bad-name": b"GET /a HTTP/1.1\r\nHost: p\r\nBad Name: x\r\n\r\n",
    "signed-length": b"POST /a HTTP/1.1\r\nHost: p\r\nContent-Length: +1\r\n\r\nx",
    "connect": b"CONNECT p:443 HTTP/1.1\r\nHost: p:443\r\n\r\n",
    "long-head": b"GET /a HTTP/1.1\r\nHost: p\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    "many-lines": b"GET /a HTTP/1.1\r\nHost: p\r\n" + b"X-N: 1\r\n" * 130 + b"\r\n",
    "large-body": post("/a", body=b"x" * (front.WHOLE_BODY + 1)),
}


@pytest.mark.parametrize("case", NOT_PLAIN)
async def test_what_is_not_plain_is_answered_by_aiohttp_as_without_the_fast_path(
    listen: Start, handed_off: list[bytes], case: str
) -> None:
    fast = await listen()
    aiohttp_only = await listen(server={"fast_path": False})
    answers = []
    for proxy in (fast, aiohttp_only):
        client = await Client.connect(proxy.port)
        try:
            await client.send(NOT_PLAIN[case])
            answers.append(_comparable(await client.everything()))
        finally:
            await client.close()
    assert answers[0] == answers[1] and answers[0]
    assert len(handed_off) == 1 and NOT_PLAIN[case].startswith(handed_off[0])


def _comparable(answer: bytes) -> bytes:
    """The answer without what differs between the two backends' runs: the Date, the Location
    (the backend numbers what it executed) and the body (which echoes the proxy's port)."""
    varying = (b"Date:", b"Location:")
    lines = [line for line in answer.split(b"\r\n") if not line.startswith(varying)]
    return b"\r\n".join(lines).split(b"{", 1)[0]


async def test_a_body_that_follows_its_head_is_read_as_it_arrives(
    listen: Start, clients: Any, handed_off: list[bytes], ledger: Ledger
) -> None:
    """As many clients send it: the head, then the body in a later packet."""
    proxy = await listen()
    client = await clients(proxy.port)
    for key in ("split-1", "split-2"):
        request = post("/orders", key, b'{"amount": 1}')
        await client.send(request[:-5])
        await asyncio.sleep(0.1)
        await client.send(request[-5:])
        head, body = await client.response()
        assert status(head) == 201 and b'\\"amount\\": 1' in body
    assert ledger.count("split-1") == ledger.count("split-2") == 1
    assert handed_off == []
    assert [type(c) for c in proxy.connections()] == [front.FrontConnection]


async def test_a_body_that_stops_coming_is_408_and_the_connection_closes(
    listen: Start, clients: Any, handed_off: list[bytes], ledger: Ledger
) -> None:
    proxy = await listen(server={"body_read_timeout": 0.4})
    client = await clients(proxy.port)
    await client.send(post("/orders", "stalled", b'{"amount": 1}')[:-5])
    answer = await client.everything()
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request-timeout" in answer
    assert ledger.count("stalled") == 0
    assert handed_off == []


async def test_the_rest_of_a_body_answered_early_is_dropped_before_the_next_request(
    listen: Start, clients: Any, handed_off: list[bytes], ledger: Ledger
) -> None:
    """A declared body over max_request_body is refused at once (413); what of it still comes
    is read and dropped, and the connection serves the next request (as aiohttp lingers)."""
    proxy = await listen(max_request_body=10)
    client = await clients(proxy.port)
    request = post("/orders", "too-large", b'{"amount": 1250}')
    await client.send(request[:-8])
    assert status((await client.response())[0]) == 413
    await client.send(request[-8:] + b"GET /after HTTP/1.1\r\nHost: p\r\n\r\n")
    head, body = await client.response()
    assert status(head) == 201 and b'"path": "/after"' in body
    assert ledger.count("too-large") == 0
    assert handed_off == []


async def test_pipelined_requests_are_answered_in_order_also_across_a_hand_off(
    listen: Start, clients: Any, handed_off: list[bytes], ledger: Ledger
) -> None:
    proxy = await listen()
    client = await clients(proxy.port)
    chunked = NOT_PLAIN["chunked"].replace(b"POST /a", b"POST /three")
    await client.send(post("/one", "pipe-a") + post("/two", "pipe-b") + chunked)
    paths = []
    for _ in range(3):
        head, body = await client.response()
        assert status(head) in (200, 201), head
        paths.append(body.split(b'"path": "', 1)[1].split(b'"', 1)[0])
    assert paths == [b"/one", b"/two", b"/three"]
    assert ledger.count("pipe-a") == ledger.count("pipe-b") == 1
    assert handed_off == [chunked[:40]]


async def test_connection_close_and_head_requests(listen: Start, clients: Any) -> None:
    proxy = await listen()
    client = await clients(proxy.port)
    await client.send(b"HEAD /things HTTP/1.1\r\nHost: p\r\n\r\n")
    head = await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), IDLE)
    assert status(head) == 201  # aiohttp's response path: a head, no body
    await client.send(b"GET /things HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n")
    head, body = await client.response()
    assert status(head) == 201 and b"Connection: close" in head and body
    assert await client.closed()


async def test_a_streamed_response_keeps_the_connection(listen: Start, clients: Any) -> None:
    proxy = await listen()
    client = await clients(proxy.port)
    await client.send(b"GET /big?size=200000 HTTP/1.1\r\nHost: p\r\n\r\n")
    head, body = await client.response()
    assert status(head) == 201 and len(body) == 200000
    await client.send(b"GET /next HTTP/1.1\r\nHost: p\r\n\r\n")
    assert status((await client.response())[0]) == 201


async def test_a_slow_head_gets_408_and_a_silent_connection_is_closed(
    listen: Start, clients: Any
) -> None:
    proxy = await listen(server={"header_read_timeout": 0.4})
    slow, silent = await clients(proxy.port), await clients(proxy.port)
    await slow.send(b"GET / HTTP/1.1\r\nHost")
    answer = await slow.everything()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert await silent.everything() == b""


async def test_the_next_head_gets_the_header_deadline_not_the_idle_timeout(
    listen: Start, clients: Any
) -> None:
    proxy = await listen(server={"header_read_timeout": 0.4, "keepalive_timeout": 10.0})
    client = await clients(proxy.port)
    await client.send(b"GET /a HTTP/1.1\r\nHost: p\r\n\r\n")
    await client.response()
    await asyncio.sleep(0.2)  # idle, well within the keep-alive timeout
    await client.send(b"GET /b HTTP/1.1\r\n")
    began = asyncio.get_running_loop().time()
    answer = await client.everything()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert asyncio.get_running_loop().time() - began < 1.5  # 0.4 s, not the idle 10 s


async def test_an_idle_kept_alive_connection_is_closed_silently(
    listen: Start, clients: Any
) -> None:
    proxy = await listen(server={"keepalive_timeout": 0.3})
    client = await clients(proxy.port)
    await client.send(b"GET /a HTTP/1.1\r\nHost: p\r\n\r\n")
    await client.response()
    assert await client.everything() == b""


async def test_a_head_handed_over_keeps_the_time_it_had_left(
    listen: Start, clients: Any, handed_off: list[bytes]
) -> None:
    proxy = await listen(server={"header_read_timeout": 1.0})
    client = await clients(proxy.port)
    began = asyncio.get_running_loop().time()
    await asyncio.sleep(0.6)
    # Longer than a plain head may be (aiohttp's from here), in lines it allows, unfinished.
    await client.send(b"GET /a HTTP/1.1\r\nHost: p\r\n" + b"X-Filler: " + b"a" * 90 + b"\r\n" * 1)
    await client.send((b"X-Filler: " + b"a" * 90 + b"\r\n") * 90)
    answer = await client.everything()
    elapsed = asyncio.get_running_loop().time() - began
    assert handed_off and answer.startswith(b"HTTP/1.1 408 ")
    assert elapsed < 1.5  # 1.0 s from the first byte's connection, not 0.6 + 1.0


async def test_pipelined_bytes_beyond_a_bound_pause_reading(listen: Start, clients: Any) -> None:
    proxy = await listen()
    client = await clients(proxy.port)
    body = b"x" * 60_000
    await client.send(
        b"GET /slow?delay=0.5 HTTP/1.1\r\nHost: p\r\n\r\n" + post("/p", body=body) * 6
    )
    await asyncio.sleep(0.3)
    (connection,) = proxy.connections()
    assert not connection.transport.is_reading()  # 360 kB waiting behind a slow request
    for _ in range(7):
        assert status((await client.response())[0]) == 201
    assert connection.transport.is_reading()


async def test_shutdown_answers_the_request_in_flight_and_closes_idle_connections(
    listen: Start, clients: Any
) -> None:
    proxy = await listen()
    idle, busy = await clients(proxy.port), await clients(proxy.port)
    await idle.send(b"GET /a HTTP/1.1\r\nHost: p\r\n\r\n")
    await idle.response()
    await busy.send(b"GET /slow?delay=0.3 HTTP/1.1\r\nHost: p\r\n\r\n")
    await asyncio.sleep(0.1)
    await proxy.runner.cleanup()
    head, _ = await busy.response()
    assert status(head) == 201
    assert await idle.closed() and await busy.closed()


async def test_a_handler_failure_is_a_500_and_the_connection_closes(
    listen: Start, clients: Any
) -> None:
    async def failing(request: web.Request) -> web.StreamResponse:
        if request.path == "/gone":
            raise web.HTTPGone()
        raise RuntimeError("a bug")

    app = web.Application()
    app.router.register_resource(AnyPath(failing, expect_handler=expect_continue))
    listening = await listen(app)
    gone, broken = await clients(listening.port), await clients(listening.port)
    await gone.send(b"GET /gone HTTP/1.1\r\nHost: p\r\n\r\n")
    assert status((await gone.response())[0]) == 410
    await broken.send(b"GET /bug HTTP/1.1\r\nHost: p\r\n\r\n")
    head, _ = await broken.response()
    assert status(head) == 500 and b"Connection: close" in head
    assert await broken.closed()


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "aiohttp"])
async def test_a_content_coded_body_goes_upstream_as_it_came(
    listen: Start, fast_path: bool
) -> None:
    """RFC 9110 §8.4: the coding is the client's and the backend's; aiohttp's server used to
    decompress a gzip body and send it on still labelled gzip."""
    received: list[tuple[bytes, str | None]] = []

    async def upstream_handler(request: web.Request) -> web.Response:
        received.append((await request.read(), request.headers.get("Content-Encoding")))
        return web.Response(status=201, text="{}", content_type="application/json")

    upstream_app = web.Application()
    upstream_app.router.add_route("*", "/{tail:.*}", upstream_handler)
    upstream = web.AppRunner(upstream_app, auto_decompress=False)
    await upstream.setup()
    await web.TCPSite(upstream, "127.0.0.1", 0).start()
    try:
        upstream_url = f"http://127.0.0.1:{upstream.addresses[0][1]}"
        proxy = await listen(upstream=upstream_url, server={"fast_path": fast_path})
        coded = gzip.compress(b'{"amount": 1250}', mtime=0)
        for key in (None, "coded-1"):
            client = await Client.connect(proxy.port)
            try:
                extra = b"Content-Encoding: gzip\r\n"
                if key is not None:
                    extra += f"Idempotency-Key: {key}\r\n".encode()
                await client.send(post("/orders", body=coded, extra=extra))
                assert status((await client.response())[0]) == 201
            finally:
                await client.close()
    finally:
        await upstream.cleanup()
    assert received == [(coded, "gzip"), (coded, "gzip")]
