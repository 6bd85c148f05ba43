"""The upstream client (proxy/upstream/client.py) against scripted raw-socket upstreams.

Each upstream here is a real TCP server on loopback that reads a request and writes bytes
chosen by the test, so that framing, keep-alive and every failure class (SPEC §3.2) are
exercised exactly: what was sent, what came back, and whether the connection was reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import ipaddress
import socket
import ssl
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from multidict import CIMultiDict
from yarl import URL

from idemproxy.config.settings import ContractSettings
from idemproxy.core.machine import Failure
from idemproxy.proxy.upstream.client import MAX_HEAD_BYTES, UpstreamClient, UpstreamFailure
from idemproxy.proxy.upstream.contract import Contract, check_upstream
from tests.support.recording_upstream import RecordingUpstream

LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}


def on_both_loops(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    """Run the test on asyncio's loop and on uvloop, whose transports are no asyncio
    subclasses (the proxy serves on uvloop)."""

    @pytest.mark.parametrize("loop", LOOPS)
    def on_loop(loop: str) -> None:
        LOOPS[loop](test())

    on_loop.__name__, on_loop.__doc__ = test.__name__, test.__doc__
    return on_loop


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nX-Up: 1\r\n\r\nok"


class Upstream:
    """A loopback server running `script` for every connection; records what it received."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()
        for handler in self.handlers:
            handler.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    @property
    def url(self) -> URL:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return URL(f"http://127.0.0.1:{port}/pay?x=%2F", encoded=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        handler = asyncio.current_task()
        assert handler is not None
        self.handlers.add(handler)
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await self.script(reader, writer)
        finally:
            writer.transport.abort()
            self.handlers.discard(handler)

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        request = head + (await reader.readexactly(length) if length else b"")
        self.requests.append(request)
        return request


def answering(*responses: bytes, then_close: bool = False) -> Script:
    """Answer each request on a connection with the next response, in order."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in responses:
            await upstream_of[script].read_request(reader)
            writer.write(response)
            await writer.drain()
        if not then_close:
            await reader.read()  # keep the connection open until the client closes it

    return script


upstream_of: dict[Script, Upstream] = {}


@contextlib.asynccontextmanager
async def serving(script: Script) -> AsyncIterator[Upstream]:
    upstream = Upstream(script)
    upstream_of[script] = upstream
    async with upstream:
        yield upstream
    del upstream_of[script]


@contextlib.asynccontextmanager
async def client(**overrides: float) -> AsyncIterator[UpstreamClient]:
    settings = {"timeout": 2.0, "connect_timeout": 1.0, "connections": 4, "keepalive": 30.0}
    settings.update(overrides)
    upstream_client = UpstreamClient(
        timeout=settings["timeout"],
        connect_timeout=settings["connect_timeout"],
        connections=int(settings["connections"]),
        keepalive=settings["keepalive"],
    )
    await upstream_client.open()
    try:
        yield upstream_client
    finally:
        await upstream_client.close()


async def call(
    upstream_client: UpstreamClient,
    url: URL,
    body: bytes | None = b'{"a":1}',
    method: str = "POST",
    headers: Mapping[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    async with upstream_client.request(method, url, headers or {}, body) as response:
        content, whole = await UpstreamClient.read_body(response, 1 << 20)
        assert whole
        return response.status, dict(response.headers), content


@on_both_loops
async def test_a_request_goes_out_byte_for_byte_and_its_answer_comes_back() -> None:
    async with serving(answering(OK)) as upstream, client() as upstream_client:
        port = upstream.url.port
        status, headers, body = await call(
            upstream_client, upstream.url, headers={"X-Trace": "é", "Content-Length": "99"}
        )
    assert (status, headers["X-Up"], body) == (201, "1", b"ok")
    request = upstream.requests[0]
    assert request.startswith(b"POST /pay?x=%2F HTTP/1.1\r\n")  # no re-quoting (SPEC §10)
    assert f"Host: 127.0.0.1:{port}\r\n".encode() in request  # the URL's, by default
    assert b"Content-Length: 99" not in request  # framing headers are the client's own
    assert "X-Trace: é\r\n".encode() in request
    assert request.endswith(b"Content-Length: 7\r\n\r\n" + b'{"a":1}')


@on_both_loops
async def test_the_host_among_the_headers_is_sent_once_first_in_the_urls_place() -> None:
    """SPEC §10 `forward_host`: the caller (proxy/upstream/client.py) puts the Host to send
    among the headers; it replaces the URL's authority, on the Host line the client writes."""
    async with serving(answering(OK)) as upstream, client() as upstream_client:
        headers = CIMultiDict([("X-A", "1"), ("host", "API.Example.com.")])
        await call(upstream_client, upstream.url, headers=headers)
    request = upstream.requests[0]
    assert request.startswith(b"POST /pay?x=%2F HTTP/1.1\r\nHost: API.Example.com.\r\nX-A: 1\r\n")
    assert request.count(b"ost: ") == 1


@on_both_loops
async def test_keep_alive_reuses_one_connection() -> None:
    async with serving(answering(OK, OK, OK)) as upstream, client() as upstream_client:
        for _ in range(3):
            assert (await call(upstream_client, upstream.url))[0] == 201
    assert upstream.connections == 1


@on_both_loops
async def test_a_finished_exchange_is_freed_without_the_cyclic_collector() -> None:
    """An exchange left for the cyclic collector costs every request its walk of all of them
    (docs/benchmarks.md): once the connection is back in the pool, or closed, nothing of the
    exchange may be left in a reference cycle."""
    closing = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx"
    for answer in (OK, closing):
        async with serving(answering(answer, then_close=True)) as upstream, client() as c:
            gc.disable()
            try:
                async with c.request("POST", upstream.url, {}, b"{}") as response:
                    await UpstreamClient.read_body(response, 1 << 20)
                    left = weakref.ref(response)
                del response
                assert left() is None, gc.get_referrers(left())
            finally:
                gc.enable()


async def _pieces(c: UpstreamClient, url: URL) -> list[tuple[bytes, bool]]:
    """Every `read_piece` of one answer, through `send` and `close`, up to the one that
    says it was the last."""
    exchange, response = await c.send("POST", url, {}, b"{}")
    try:
        pieces = [await response.read_piece()]
        while not pieces[-1][1]:
            pieces.append(await response.read_piece())
        return pieces
    finally:
        await exchange.close()


@on_both_loops
async def test_a_piece_says_whether_the_body_ended_with_it() -> None:
    """A capture reads no further than the body's last piece (proxy/server/capture.py): a
    body that came with its head is one piece, the last; any other ends on a piece that says
    so, and its pieces are the whole body, whatever its framing."""
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
    rest = b"2\r\nde\r\n0\r\n\r\n"

    async def in_two_writes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await upstream_of[in_two_writes].read_request(reader)
        writer.write(chunked)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(rest)
        await writer.drain()
        await reader.read()

    async with serving(answering(OK, OK)) as upstream, client() as c:
        assert await _pieces(c, upstream.url) == [(b"ok", True)]
        assert await _pieces(c, upstream.url) == [(b"ok", True)]
    assert upstream.connections == 1  # `close` gave the connection back
    async with serving(in_two_writes) as upstream, client() as c:
        pieces = await _pieces(c, upstream.url)
    assert b"".join(piece for piece, _ in pieces) == b"abcde"
    assert [last for _, last in pieces] == [False] * (len(pieces) - 1) + [True]
    empty = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    async with serving(answering(empty)) as upstream, client() as c:
        assert await _pieces(c, upstream.url) == [(b"", True)]


@on_both_loops
async def test_with_keepalive_zero_each_request_has_a_connection_of_its_own() -> None:
    """`pool.upstream_keepalive: 0`: nothing is reused, and the upstream is told so; bytes an
    upstream writes after its answer then reach no other request (docs/operations.md)."""
    late = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nLATE!"

    async def answers_then_writes_again(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await upstream_of[answers_then_writes_again].read_request(reader)
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.02)
        with contextlib.suppress(ConnectionError):
            writer.write(late)
            await writer.drain()
        await reader.read()

    async with serving(answers_then_writes_again) as upstream, client(keepalive=0) as c:
        for _ in range(3):
            status, _, body = await call(c, upstream.url)
            assert (status, body) == (201, b"ok")
            await asyncio.sleep(0.05)
    assert upstream.connections == 3
    assert all(b"\r\nConnection: close\r\n" in request for request in upstream.requests)
    assert all(request.count(b"\r\n\r\n") == 1 for request in upstream.requests)


@on_both_loops
async def test_connection_close_is_honoured() -> None:
    closing = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx"
    async with serving(answering(closing, then_close=True)) as upstream, client() as c:
        await call(c, upstream.url)
        await call(c, upstream.url)
    assert upstream.connections == 2


@on_both_loops
async def test_a_body_less_post_declares_length_zero_and_a_get_declares_nothing() -> None:
    async with serving(answering(OK, OK)) as upstream, client() as c:
        await call(c, upstream.url, body=None)
        await call(c, upstream.url, body=None, method="GET")
    assert b"Content-Length: 0\r\n" in upstream.requests[0]
    assert b"Content-Length" not in upstream.requests[1]


@on_both_loops
async def test_interim_responses_are_skipped() -> None:
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
    async with serving(answering(early + OK)) as upstream, client() as c:
        status, headers, body = await call(c, upstream.url)
    assert (status, body) == (201, b"ok")
    assert "Link" not in headers


@on_both_loops
async def test_chunked_and_close_delimited_bodies_are_read_whole() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    until_close = b"HTTP/1.1 200 OK\r\n\r\nall of it"
    async with serving(answering(chunked)) as upstream, client() as c:
        assert (await call(c, upstream.url))[2] == b"abcde"
    async with serving(answering(until_close, then_close=True)) as upstream, client() as c:
        assert (await call(c, upstream.url))[2] == b"all of it"


@on_both_loops
async def test_head_and_204_have_no_body_and_head_is_not_reused() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"
    no_content = b"HTTP/1.1 204 No Content\r\n\r\n"
    async with serving(answering(no_content, no_content)) as upstream, client() as c:
        assert (await call(c, upstream.url))[:3:2] == (204, b"")
        await call(c, upstream.url)
    assert upstream.connections == 1
    async with serving(answering(head)) as upstream, client() as c:
        assert await call(c, upstream.url, method="HEAD", body=None) == (
            200,
            {"Content-Length": "10"},
            b"",
        )
        async with serving(answering(head)) as other:
            await call(c, other.url, method="HEAD", body=None)


@on_both_loops
async def test_refused_connection_is_a_connect_failure() -> None:
    async with serving(answering(OK)) as upstream:
        url = upstream.url
    async with client() as c:
        with pytest.raises(UpstreamFailure) as failure:
            await call(c, url)
    assert failure.value.failure is Failure.CONNECT  # nothing was sent: safe to retry


@on_both_loops
async def test_no_answer_in_time_is_a_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with serving(silent) as upstream, client(timeout=0.3) as c:
        with pytest.raises(UpstreamFailure) as failure:
            await call(c, upstream.url)
    assert failure.value.failure is Failure.TIMEOUT


@on_both_loops
async def test_on_a_kept_alive_connection_each_wait_has_its_own_timeout() -> None:
    """The connection's one deadline timer was set during the first exchange; the second,
    which starts later, must get its whole timeout from its own start."""
    answered = 0

    async def slower_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        for delay in (0.0, 0.3):
            await upstream_of[slower_second].read_request(reader)
            await asyncio.sleep(delay)
            writer.write(OK)
            await writer.drain()
            answered += 1
        await reader.read()

    async with serving(slower_second) as upstream, client(timeout=0.4) as c:
        began = time.monotonic()
        assert (await call(c, upstream.url))[0] == 201
        await asyncio.sleep(0.2)  # the first wait's deadline (0.4 s) passes during the second
        assert (await call(c, upstream.url))[0] == 201
        assert time.monotonic() - began > 0.45
    assert (upstream.connections, answered) == (1, 2)


@on_both_loops
async def test_a_reset_after_the_request_is_broken() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await upstream_of[hang_up].read_request(reader)
        writer.transport.abort()

    async with serving(hang_up) as upstream, client() as c:
        with pytest.raises(UpstreamFailure) as failure:
            await call(c, upstream.url)
    assert failure.value.failure is Failure.BROKEN  # it may have executed: unknown


@on_both_loops
async def test_garbage_and_protocol_switches_are_broken() -> None:
    for answer in (b"NOT HTTP AT ALL\r\n\r\n", b"HTTP/1.1 101 Switching\r\nUpgrade: x\r\n\r\n"):
        async with serving(answering(answer)) as upstream, client() as c:
            with pytest.raises(UpstreamFailure) as failure:
                await call(c, upstream.url)
        assert failure.value.failure is Failure.BROKEN


@on_both_loops
async def test_a_body_cut_off_mid_way_is_broken() -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"
    async with (
        serving(answering(cut, then_close=True)) as upstream,
        client() as c,
        c.request("POST", upstream.url, {}, b"x") as response,
    ):
        assert response.status == 200
        with pytest.raises(UpstreamFailure) as failure:
            await UpstreamClient.read_body(response, 1 << 20)
    assert failure.value.failure is Failure.BROKEN


@on_both_loops
async def test_a_header_with_a_line_break_is_never_sent() -> None:
    async with serving(answering(OK)) as upstream, client() as c:
        with pytest.raises(UpstreamFailure) as failure:
            await call(c, upstream.url, headers={"X-A": "1\r\nX-Smuggled: 2"})
    assert failure.value.failure is Failure.CONNECT
    assert upstream.requests == []


@on_both_loops
async def test_a_streamed_body_of_unknown_length_goes_chunked() -> None:
    async def parts() -> AsyncIterator[bytes]:
        yield b"abc"
        yield b"defg"

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        rest = await reader.readuntil(b"0\r\n\r\n")
        upstream_of[record].requests.append(head + rest)
        writer.write(OK)
        await writer.drain()
        await reader.read()

    async with (
        serving(record) as upstream,
        client() as c,
        c.request("POST", upstream.url, {}, parts()) as response,
    ):
        assert response.status == 201
    assert b"Transfer-Encoding: chunked\r\n" in upstream.requests[0]
    assert upstream.requests[0].endswith(b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n")


@on_both_loops
async def test_the_pool_limit_holds_requests_until_a_connection_is_free() -> None:
    gate = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await upstream_of[slow].read_request(reader)
            await gate.wait()
            writer.write(OK)
            await writer.drain()

    async with serving(slow) as upstream, client(connections=2) as c:
        calls = [asyncio.create_task(call(c, upstream.url)) for _ in range(5)]
        await asyncio.sleep(0.2)
        assert upstream.connections == 2  # the other three wait for a free connection
        gate.set()
        assert [status for status, _, _ in await asyncio.gather(*calls)] == [201] * 5
    assert upstream.connections == 2


@on_both_loops
async def test_waiting_for_a_free_connection_past_the_connect_timeout_sends_nothing() -> None:
    async def silent(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with serving(silent) as upstream, client(connections=1, connect_timeout=0.2) as c:
        first = asyncio.create_task(call(c, upstream.url))
        await asyncio.sleep(0.05)
        with pytest.raises(UpstreamFailure) as failure:
            await call(c, upstream.url)
        assert failure.value.failure is Failure.CONNECT
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError, UpstreamFailure):
            await first


@on_both_loops
async def test_idle_connections_expire_after_keepalive() -> None:
    async with serving(answering(OK, OK)) as upstream, client(keepalive=0.2) as c:
        await call(c, upstream.url)
        await asyncio.sleep(0.4)
        async with serving(answering(OK)) as fresh:
            await call(c, fresh.url)
        assert upstream.connections == 1
        await call(c, upstream.url)  # the idle one was closed: a new connection
    assert upstream.connections == 2


@on_both_loops
async def test_a_large_streamed_answer_is_flow_controlled_not_timed_out() -> None:
    """Reading paused by a slow consumer is not upstream slowness (proxy/upstream/client.py)."""
    size = 8 * 1024 * 1024

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await upstream_of[big].read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"z" * 65536)
            await writer.drain()
        await reader.read()

    received = 0
    async with (
        serving(big) as upstream,
        client(timeout=0.3) as c,
        c.request("POST", upstream.url, {}, b"x") as response,
    ):
        async for chunk in UpstreamClient.iter_body(response):
            received += len(chunk)
            if received < 1024 * 1024:
                await asyncio.sleep(0.05)  # a slow client, for longer than the timeout
    assert received == size


@on_both_loops
async def test_an_upstream_silent_mid_body_past_the_timeout_is_a_timeout() -> None:
    """The timeout bounds the head, then each silence in the body; a body that keeps flowing
    is not cut off however long it takes (nginx's proxy_read_timeout)."""

    async def pausing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await upstream_of[pausing].read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n")
        for _ in range(10):  # 10 x 0.1 s: longer in all than the timeout, never silent for it
            await asyncio.sleep(0.1)
            writer.write(b"z")
            await writer.drain()
        await asyncio.sleep(1.0)  # then silent
        writer.write(b"z" * 10)

    pieces = b""
    async with (
        serving(pausing) as upstream,
        client(timeout=0.4) as c,
        c.request("POST", upstream.url, {}, b"x") as response,
    ):
        with pytest.raises(UpstreamFailure) as failure:
            async for chunk in UpstreamClient.iter_body(response):
                pieces += chunk
    assert pieces == b"z" * 10
    assert failure.value.failure is Failure.TIMEOUT


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that is its own CA, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "idemproxy test upstream")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "upstream.pem", folder / "upstream.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
def test_an_https_upstream_is_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trusted: bool
) -> None:
    """TLS to the upstream with the system's verification; an unknown certificate is a
    connect failure, so nothing was sent (SPEC §3.2)."""
    cert, key = _self_signed(tmp_path)
    if trusted:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # read by ssl.create_default_context
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def scenario() -> None:
        received: list[bytes] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                received.append(await reader.readuntil(b"\r\n\r\n"))
                writer.write(OK)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_tls)
        port = server.sockets[0].getsockname()[1]
        url = URL(f"https://127.0.0.1:{port}/pay", encoded=True)
        try:
            async with client() as c:
                if trusted:
                    assert (await call(c, url, body=None, method="GET"))[::2] == (201, b"ok")
                    assert received[0].startswith(b"GET /pay HTTP/1.1\r\n")
                else:
                    with pytest.raises(UpstreamFailure) as failure:
                        await call(c, url)
                    assert failure.value.failure is Failure.CONNECT
                    assert received == []
        finally:
            server.close()

    uvloop.run(scenario())


def _answer_then_close(listener: socket.socket, connections: list[int]) -> None:
    """A blocking upstream in a thread of its own: it can close while the loop is blocked."""
    for _ in range(2):
        conn, _ = listener.accept()
        connections.append(1)
        with conn:
            data = b""
            while not data.endswith(b'{"a":1}'):
                data += conn.recv(65536)
            conn.sendall(OK)  # a keep-alive answer ...
            time.sleep(0.05)  # ... then the upstream's own idle timeout closes it


@on_both_loops
async def test_an_idle_connection_the_upstream_closed_is_never_reused() -> None:
    """The upstream closed an idle keep-alive connection and the loop has not handled that
    close yet when the next request wants the connection: it must take a new one, or the
    request would go into a closing socket and its outcome would be unknown (SPEC §3.2)."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[int] = []
    thread = threading.Thread(target=_answer_then_close, args=(listener, connections))
    thread.start()
    url = URL(f"http://127.0.0.1:{listener.getsockname()[1]}/pay", encoded=True)
    try:
        async with client() as c:
            await call(c, url)
            time.sleep(0.3)  # noqa: ASYNC251 - on purpose: the close reaches the kernel, not our loop
            assert (await call(c, url))[0] == 201
    finally:
        thread.join(5)
        listener.close()
    assert len(connections) == 2


@on_both_loops
async def test_an_endless_response_head_is_broken_not_buffered_for_ever() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await upstream_of[endless].read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
        for _ in range(2 * MAX_HEAD_BYTES // 65536):
            writer.write(b"a" * 65536)
            await writer.drain()
        await reader.read()

    async with serving(endless) as upstream, client() as c:
        with pytest.raises(UpstreamFailure) as failure:
            await call(c, upstream.url)
    assert failure.value.failure is Failure.BROKEN
    assert "too large" in failure.value.reason


async def test_a_contract_samples_own_host_header_is_not_sent(tmp_path: Path) -> None:
    """The client sends a Host found among the headers (SPEC §10 `forward_host`); a contract
    sample's headers are the samples file's, whose Host was always ignored: it still is."""
    schema, samples = tmp_path / "schema.json", tmp_path / "samples.jsonl"
    schema.write_text("{}")
    samples.write_text('{"path": "/v1/chat", "headers": {"Host": "sample.example", "X-S": "1"}}\n')
    contract = Contract(ContractSettings(schema_file=schema, samples_file=samples))
    async with RecordingUpstream() as upstream, client() as upstream_client:
        await check_upstream(upstream_client, upstream.url, contract)
    assert upstream.one.header_lines("Host") == [upstream.url.removeprefix("http://").encode()]
    assert upstream.one.header_lines("X-S") == [b"1"]
