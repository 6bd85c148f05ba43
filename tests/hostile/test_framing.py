"""SPEC §8, §9: malformed framing against a real `idemproxy serve`, with both aiohttp parsers.

Every case is a governed request (POST with an Idempotency-Key) whose framing is broken: it must
get a clean 4xx (400, or 413 for an absurd length) or a closed connection; nothing may reach the
backend and no job may exist afterwards. Each case runs against two proxy processes: one with
aiohttp's C parser (llhttp, the default) and one with its pure-Python parser
(`AIOHTTP_NO_EXTENSIONS=1`), which differ in what they tolerate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from idemproxy.store.factory import create_store
from tests.support.backend import Ledger, backend_app
from tests.support.ports import free_port
from tests.support.processes import ProxyProcess, child_env

pytestmark = pytest.mark.slow

HEAD = b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: framing\r\n"

CASES: dict[str, bytes] = {
    # RFC 9112 §6.3: Content-Length with Transfer-Encoding is request smuggling's classic.
    "length-and-chunked": HEAD
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "chunked-and-length": HEAD
    + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "two-lengths": HEAD + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "two-equal-lengths": HEAD + b"Content-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
    "length-list": HEAD + b"Content-Length: 3, 3\r\n\r\nabc",
    "length-plus": HEAD + b"Content-Length: +3\r\n\r\nabc",
    "length-negative": HEAD + b"Content-Length: -1\r\n\r\nabc",
    "length-hex": HEAD + b"Content-Length: 0x3\r\n\r\nabc",
    "length-inner-space": HEAD + b"Content-Length: 1 2\r\n\r\nabc",
    "length-overflow": HEAD + b"Content-Length: 99999999999999999999999\r\n\r\nabc",
    "coding-not-chunked": HEAD + b"Transfer-Encoding: gzip\r\n\r\nabc",
    "chunked-not-last": HEAD + b"Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
    # RFC 9112 §6.1: aiohttp removes the final chunked and hands on the still-coded bytes as
    # the body; forwarded as the identity body they would mean something else.
    "coding-before-chunked": HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "coding-line-before-chunked": HEAD
    + b"Transfer-Encoding: deflate\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "xchunked": HEAD + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "two-chunked": HEAD
    + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "bad-chunk-size": HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "chunk-size-bare-lf": HEAD + b"Transfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n",
    # RFC 9112 §5.2: obs-fold is rejected with 400 (or replaced by SP; aiohttp rejects).
    "obs-fold": HEAD + b"X-Note: a\r\n b\r\nContent-Length: 0\r\n\r\n",
    "obs-fold-in-key": b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: a\r\n b\r\n"
    b"Content-Length: 0\r\n\r\n",
    "bare-lf-everywhere": b"POST /pay HTTP/1.1\nHost: proxy\nIdempotency-Key: framing\n"
    b"Content-Length: 0\n\n",
    "bare-lf-once": HEAD + b"X-Note: a\nContent-Length: 0\r\n\r\n",
    "bare-cr": HEAD + b"X-Note: a\rX-Other: b\r\nContent-Length: 0\r\n\r\n",
    "nul-in-value": HEAD + b"X-Note: a\x00b\r\nContent-Length: 0\r\n\r\n",
    "cr-in-value": HEAD + b"X-Note: a\rb\r\nContent-Length: 0\r\n\r\n",
    "nul-in-key": b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: a\x00b\r\n"
    b"Content-Length: 0\r\n\r\n",
    "space-before-colon": HEAD + b"Content-Length : 3\r\n\r\nabc",
    "space-in-name": HEAD + b"X Note: b\r\nContent-Length: 0\r\n\r\n",
    "empty-name": HEAD + b": b\r\nContent-Length: 0\r\n\r\n",
    # SPEC §9: server.max_field_size / max_line_size (8190) and server.max_headers (128).
    "oversized-header": HEAD + b"X-Big: " + b"a" * 9000 + b"\r\nContent-Length: 0\r\n\r\n",
    "oversized-request-line": b"POST /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: proxy\r\n"
    b"Idempotency-Key: framing\r\nContent-Length: 0\r\n\r\n",
    "too-many-headers": HEAD
    + b"".join(b"X-H%d: v\r\n" % i for i in range(130))
    + b"Content-Length: 0\r\n\r\n",
    # RFC 9112 §3.2: more than one Host, or none in HTTP/1.1, is 400.
    "two-hosts": b"POST /pay HTTP/1.1\r\nHost: a\r\nHost: b\r\nIdempotency-Key: framing\r\n"
    b"Content-Length: 0\r\n\r\n",
    "no-host": b"POST /pay HTTP/1.1\r\nIdempotency-Key: framing\r\nContent-Length: 0\r\n\r\n",
    # …and so is a Host value that is not host[:port] (aiohttp's parsers let this one through).
    "host-list": b"POST /pay HTTP/1.1\r\nHost: a, b\r\nIdempotency-Key: framing\r\n"
    b"Content-Length: 0\r\n\r\n",
    "bad-method-token": b"P<ST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: framing\r\n"
    b"Content-Length: 0\r\n\r\n",
    # A smuggled second request hidden in a body of disputed length is never run.
    "smuggled-in-body": HEAD + b"Content-Length: 44\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\nPOST /hidden HTTP/1.1\r\nHost: proxy\r\n\r\n",
}

PARSERS = {"c-parser": {}, "python-parser": {"AIOHTTP_NO_EXTENSIONS": "1"}}


class Proxies:
    """The backend (in a thread of its own: module-scoped, loop-independent) and one proxy
    process per parser."""

    def __init__(self, tmp: Path) -> None:
        self.ledger = Ledger()
        self.tmp = tmp
        self.processes: dict[str, ProxyProcess] = {}
        self.stores: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(backend_app(self.ledger), access_log=None)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.backend_url = ""

    def start(self) -> None:
        self._thread.start()
        self.backend_url = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        for name, env in PARSERS.items():
            self.stores[name] = f"sqlite:///{self.tmp}/{name}.db"
            self.processes[name] = self._spawn(name, env)

    async def _serve(self) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    def _spawn(self, name: str, env: dict[str, str]) -> ProxyProcess:
        port = free_port()
        args = ["--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{free_port()}"]
        args += ["--upstream", self.backend_url, "--store", self.stores[name]]
        process = ProxyProcess(name, args, port, 0, self.tmp, self.tmp)
        process.spawn(child_env({**env, "IDEMPROXY_SERVER__HEADER_READ_TIMEOUT": "2"}))
        deadline = time.monotonic() + 20
        while True:
            assert process.running, process.describe()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return process
            assert time.monotonic() < deadline, process.describe()
            time.sleep(0.05)

    def stop(self) -> None:
        for process in self.processes.values():
            _stop(process)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def _stop(process: ProxyProcess) -> None:
    """SIGTERM, a bounded wait, then SIGKILL; always reaped."""
    if process.running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while process.running and time.monotonic() < deadline:
            time.sleep(0.02)
    process.kill()


@pytest.fixture(scope="module")
def proxies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxies]:
    running = Proxies(tmp_path_factory.mktemp("framing"))
    running.start()
    try:
        yield running
    finally:
        running.stop()


async def exchange(port: int, data: bytes, idle: float = 2.0) -> bytes:
    """Send raw bytes; what the proxy answers until it closes the connection or, once it has
    answered, falls silent (aiohttp lingers up to 10 s over an unread body before closing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = b""
    try:
        writer.write(data)
        await writer.drain()
        while chunk := await asyncio.wait_for(reader.read(65536), idle):
            answer += chunk
    except TimeoutError:
        assert answer, "no answer at all, and the connection is still open"
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return answer


def request(path: str, key: str, extra: bytes = b"") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: p\r\nIdempotency-Key: {key}\r\nContent-Length: 1\r\n"
    return head.encode() + extra + b"\r\nx"


async def job_count(dsn: str) -> int:
    store = create_store(dsn)
    await store.open()
    try:
        return len(await store.list_jobs())
    finally:
        await store.close()


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("case", CASES)
async def test_malformed_framing_is_refused_before_anything_happens(
    proxies: Proxies, parser: str, case: str
) -> None:
    executed = len(proxies.ledger.executions)
    jobs = await job_count(proxies.stores[parser])
    answer = await exchange(proxies.processes[parser].port, CASES[case])
    status_line = answer.split(b"\r\n", 1)[0]
    # A clean 4xx (the connection then closed, as exchange() waited for), or just a close.
    assert answer == b"" or status_line.split(b" ")[1] in (b"400", b"413"), answer[:200]
    assert b"\x00" not in answer and b"framing" not in answer  # SPEC §8: no echo
    await asyncio.sleep(0.05)
    assert len(proxies.ledger.executions) == executed, proxies.ledger.executions[-1]
    assert await job_count(proxies.stores[parser]) == jobs


@pytest.mark.parametrize("parser", PARSERS)
async def test_pipelined_requests_are_answered_in_order_each_once(
    proxies: Proxies, parser: str
) -> None:
    one = request("/one", f"pipe-1-{parser}")
    two = request("/two", f"pipe-2-{parser}", b"Connection: close\r\n")
    jobs = await job_count(proxies.stores[parser])
    answer = await exchange(proxies.processes[parser].port, one + two)
    assert answer.count(b"HTTP/1.1 201 Created") == 2
    assert answer.index(b'"path": "/one"') < answer.index(b'"path": "/two"')
    assert proxies.ledger.count(f"pipe-1-{parser}") == proxies.ledger.count(f"pipe-2-{parser}") == 1
    assert await job_count(proxies.stores[parser]) == jobs + 2


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_declined_upgrade_and_the_request_behind_it_are_each_answered_once(
    proxies: Proxies, parser: str
) -> None:
    """aiohttp stops parsing after an `Upgrade` request and feeds what followed it once that
    request is answered: such an answer goes aiohttp's own way, not one write
    (proxy/server/connection.py)."""
    upgrade = request(
        "/one", f"upgrade-1-{parser}", b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
    )
    after = request("/two", f"upgrade-2-{parser}", b"Connection: close\r\n")
    answer = await exchange(proxies.processes[parser].port, upgrade + after)
    assert answer.count(b"HTTP/1.1 201 Created") == 2, answer
    assert answer.index(b'"path": "/one"') < answer.index(b'"path": "/two"')
    assert proxies.ledger.count(f"upgrade-1-{parser}") == 1
    assert proxies.ledger.count(f"upgrade-2-{parser}") == 1


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize(
    "name", [b"Host", b"Transfer-Encoding", b"Content-Type", b"Content-Length"]
)
async def test_a_field_given_twice_that_must_be_one_is_header_invalid(
    proxies: Proxies, parser: str, name: bytes
) -> None:
    """SPEC §10: a second `Host` line is `400 header-invalid`, a problem document like every
    answer of the proxy's own (§8), also when the HTTP parser is what refuses it."""
    key = f"twice-{parser}-{name.decode()}"
    head = b"POST /pay HTTP/1.1\r\nHost: p\r\nIdempotency-Key: " + key.encode() + b"\r\n"
    values = (b"1", b"2") if name == b"Content-Length" else (b"x", b"y")
    twice = b"".join(b"%s: %s\r\n" % (name, v) for v in values)
    if name == b"Host":
        head, twice = head.replace(b"Host: p\r\n", b""), b"Host: a\r\nHost: b\r\n"
    framing = b"" if name == b"Content-Length" else b"Content-Length: 0\r\n"
    answer = await exchange(proxies.processes[parser].port, head + twice + framing + b"\r\n")
    status, _, rest = answer.partition(b"\r\n")
    assert status in (b"HTTP/1.0 400 Bad Request", b"HTTP/1.1 400 Bad Request"), answer[:300]
    head_part, _, body = rest.partition(b"\r\n\r\n")
    assert b"Idempotency-Error: header-invalid" in head_part
    assert b"Content-Type: application/problem+json" in head_part
    assert json.loads(body)["code"] == "header-invalid"
    assert b"request_id" not in body  # made once for every connection: nobody's id in it
    assert proxies.ledger.count(key) == 0


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("protocol", [b"h2c", b"foo/1"])
async def test_a_request_behind_an_upgrade_aiohttp_does_not_take_is_never_left_waiting(
    proxies: Proxies, parser: str, protocol: bytes
) -> None:
    """aiohttp's C parser loses what follows, in the same read, an `Upgrade` request to any
    protocol but WebSocket. The request behind it would never be answered, the client waiting
    for `keepalive_timeout`: the connection closes after the first answer instead, the second
    request unrun (RFC 9112 §9.3.2: the client sends it again), and its retry runs once."""
    first = request("/one", f"h2c-1-{parser}-{protocol.decode()}", b"Connection: Upgrade\r\n"
                    b"Upgrade: " + protocol + b"\r\n")  # fmt: skip
    key = f"h2c-2-{parser}-{protocol.decode()}"
    reader, writer = await asyncio.open_connection("127.0.0.1", proxies.processes[parser].port)
    try:
        writer.write(first + request("/two", key))
        answer = await asyncio.wait_for(reader.read(), 3.0)  # until the proxy closes
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 201 Created"), answer[:200]
    assert answer.count(b"HTTP/1.1 ") <= 2 and b'"path": "/one"' in answer
    again = await exchange(proxies.processes[parser].port, request("/two", key))
    assert again.startswith(b"HTTP/1.1 201 Created"), again[:200]
    assert proxies.ledger.count(key) == 1


TWO = b"POST /two HTTP/1.1\r\nHost: p\r\nIdempotency-Key: {key}\r\nContent-Length: 1\r\n\r\nx"
H2C = b"Connection: Upgrade\r\nUpgrade: h2c\r\n"
UPGRADE_SPLITS = {
    # The Upgrade head without its last CRLF, then that CRLF and a whole request.
    "head cut": (b"GET /u HTTP/1.1\r\nHost: p\r\n" + H2C, b"\r\n" + TWO),
    # The Upgrade POST's head, then its body and a whole request.
    "body later": (
        b"POST /u HTTP/1.1\r\nHost: p\r\n" + H2C + b"Content-Length: 1\r\n\r\n",
        b"x" + TWO,
    ),
    # A CONNECT, then a whole request (aiohttp's parsers differ on what follows a CONNECT).
    "connect": (b"CONNECT p:443 HTTP/1.1\r\nHost: p:443\r\n\r\n", TWO),
    # Look-alikes of `websocket` that Python's str methods fold to it and the C parser does not
    # take for it: a no-break space after it, a Kelvin sign for its `k`.
    "websocket and a no-break space": (
        b"GET /u HTTP/1.1\r\nHost: p\r\nConnection: Upgrade\r\nUpgrade: websocket\xc2\xa0\r\n\r\n",
        TWO,
    ),
    "websocket with a kelvin sign": (
        b"GET /u HTTP/1.1\r\nHost: p\r\nConnection: Upgrade\r\n"
        b"Upgrade: websoc\xe2\x84\xaaet\r\n\r\n",
        TWO,
    ),
}


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("case", UPGRADE_SPLITS)
async def test_after_an_upgrade_or_a_connect_the_connection_closes_after_its_answer(
    proxies: Proxies, parser: str, case: str
) -> None:
    """Whatever reads the request behind it came in: one answer, which says the connection
    closes after it (SPEC §8; RFC 9112 §9.6: the client sends what it pipelined again), never
    a 408 the client pairs with the request behind it. aiohttp may linger over unread bytes
    before it closes."""
    key = f"split-{parser}-{case}".replace(" ", "-")
    first, later = UPGRADE_SPLITS[case]
    reader, writer = await asyncio.open_connection("127.0.0.1", proxies.processes[parser].port)
    closed = False
    try:
        writer.write(first)
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(later.replace(b"{key}", key.encode()))
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionError):  # until it closes, or 3 s
            while chunk := await asyncio.wait_for(reader.read(65536), 3.0):
                answer += chunk
            closed = True
    finally:
        writer.close()
    # Closed after the answer, as it says: not lingering over what follows (10 s on the Python
    # parser after a CONNECT).
    assert closed, answer[:400]
    assert answer.count(b"HTTP/1.1 ") == 1, answer[:400]
    assert b"\r\nConnection: close\r\n" in answer.partition(b"\r\n\r\n")[0] + b"\r\n"
    assert b"408 Request Timeout" not in answer
    assert proxies.ledger.count(key) == 0
    again = await exchange(proxies.processes[parser].port, request("/two", key))
    assert again.startswith(b"HTTP/1.1 201 Created"), again[:200]
    assert proxies.ledger.count(key) == 1


@pytest.mark.parametrize("parser", PARSERS)
async def test_garbage_pipelined_after_a_request_never_answers_the_request_with_400(
    proxies: Proxies, parser: str
) -> None:
    """aiohttp parses what one read brought as a unit: garbage right behind a valid request in
    the same read gets the whole read refused, the request dropped unrun. A 400 would be read as
    that request's answer (SPEC §7), so the connection closes unanswered and the client retries
    it (RFC 9112 §9.3.2). If the read is split, the request runs once and the garbage alone gets
    its 400. Never more."""
    key = f"pipe-3-{parser}"
    jobs = await job_count(proxies.stores[parser])
    answer = await exchange(
        proxies.processes[parser].port, request("/one", key) + b"NOT HTTP AT ALL\r\n\r\n"
    )
    ran = proxies.ledger.count(key)
    if answer:
        assert answer.startswith(b"HTTP/1.1 201 Created"), answer[:200]
        assert answer.count(b"400 Bad Request") == 2  # status line and body, after the 201
        assert ran == 1
    else:
        assert ran == 0
    assert await job_count(proxies.stores[parser]) == jobs + ran


@pytest.mark.parametrize("parser", PARSERS)
async def test_garbage_after_a_whole_chunked_request_never_answers_it_with_400(
    proxies: Proxies, parser: str
) -> None:
    """As above, with the first request's body chunked: its end is its last chunk."""
    key = f"pipe-4-{parser}"
    head = f"POST /one HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: {key}\r\n".encode()
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    answer = await exchange(
        proxies.processes[parser].port,
        chunked + b"GET /m HTTP/1.1\r\nHost: proxy\r\nBad Header: 1\r\n\r\n",
    )
    ran = proxies.ledger.count(key)
    if answer:
        assert answer.startswith(b"HTTP/1.1 201 Created") and ran == 1, answer[:200]
    else:
        assert ran == 0


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_malformed_request_with_its_body_in_the_same_read_gets_its_400(
    proxies: Proxies, parser: str
) -> None:
    """The close above is only for a read holding more than the refused request: a malformed
    head with a body (without a line end) is answered 400 as before."""
    answer = await exchange(
        proxies.processes[parser].port,
        HEAD + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    )
    assert answer.startswith((b"HTTP/1.0 400 Bad Request\r\n", b"HTTP/1.1 400 Bad Request\r\n"))


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_slow_head_is_cut_off_by_header_read_timeout(proxies: Proxies, parser: str) -> None:
    """SPEC §9 in the real process: server.header_read_timeout (2 s here) cuts a trickle off."""
    jobs = await job_count(proxies.stores[parser])
    reader, writer = await asyncio.open_connection("127.0.0.1", proxies.processes[parser].port)
    began = time.monotonic()
    answer = asyncio.ensure_future(reader.read())  # everything until the proxy closes
    with contextlib.suppress(ConnectionError):
        writer.write(HEAD)
        while not answer.done() and time.monotonic() - began < 6:
            writer.write(b"X-Slow: 1\r\n")
            await writer.drain()
            await asyncio.wait([answer], timeout=0.2)
    cut_after = time.monotonic() - began
    writer.close()
    assert 1.5 < cut_after < 4
    assert (await answer).startswith(b"HTTP/1.1 408 Request Timeout")
    assert await job_count(proxies.stores[parser]) == jobs


BAD = b"GET /m HTTP/1.1\r\nHost: p\r\nBad Header: 1\r\n\r\n"


async def _send(writer: asyncio.StreamWriter, pieces: list[bytes | float]) -> None:
    """Each piece in a write of its own; a float is a pause of that many seconds."""
    for piece in pieces:
        if isinstance(piece, float):
            await asyncio.sleep(piece)
        else:
            writer.write(piece)
            await writer.drain()


async def _collect(reader: asyncio.StreamReader, idle: float = 3.0) -> bytes:
    answer = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        while chunk := await asyncio.wait_for(reader.read(65536), idle):
            answer += chunk
    return answer


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_refused_read_behind_a_served_request_is_closed_whatever_came_after(
    proxies: Proxies, parser: str
) -> None:
    """A valid request and a malformed one in one read while another is served, then any
    further read: the valid one is dropped with the read, so the 400 would be paired with it
    (SPEC §8). It was written because the decision looked at the last read, not the refused."""
    first, second = f"served-{parser}", f"dropped-{parser}"
    reader, writer = await asyncio.open_connection("127.0.0.1", proxies.processes[parser].port)
    try:
        writer.write(request("/a?delay=1", first))
        await asyncio.sleep(0.2)
        writer.write(request("/b", second) + BAD)
        await asyncio.sleep(0.2)
        writer.write(b"\r\n")
        answer = await _collect(reader)
    finally:
        writer.close()
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 201"), answer[:300]
    assert b" 400 " not in answer
    assert (proxies.ledger.count(first), proxies.ledger.count(second)) == (1, 0)


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_refusal_behind_more_requests_than_aiohttp_queues_is_closed(
    proxies: Proxies, parser: str
) -> None:
    """Forty pipelined requests, a keyed POST and a malformed request in one write: aiohttp
    parses what it held back later, in a read of no bytes. What was dropped is never answered
    with a 400 a client would pair with the first of them."""
    key = f"held-back-{parser}"
    gets = b"GET /g HTTP/1.1\r\nHost: p\r\n\r\n" * 40
    answer = await exchange(proxies.processes[parser].port, gets + request("/p", key) + BAD, 3.0)
    assert b" 400 " not in answer, answer[-300:]
    statuses = answer.count(b"HTTP/1.1 ")
    assert statuses <= 41 and proxies.ledger.count(key) == (1 if statuses == 41 else 0)


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_refusal_behind_a_chunked_request_too_long_to_walk_is_closed(
    proxies: Proxies, parser: str
) -> None:
    """More chunks than the walk follows in one read, a trailer, then a malformed request: where
    the chunked request ends cannot be told, so no 400 that would be paired with it."""
    key = f"many-chunks-{parser}"
    head = f"POST /c HTTP/1.1\r\nHost: p\r\nIdempotency-Key: {key}\r\n".encode()
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * 300
    answer = await exchange(
        proxies.processes[parser].port, chunked + b"0\r\nX-T: 1\r\n\r\n" + BAD, 3.0
    )
    assert b" 400 " not in answer, answer[:300]
    assert proxies.ledger.count(key) == (1 if answer else 0)


BROKEN_LATER = {
    "chunk size": b"3\r\nabc\r\nzz\r\n",
    "no line end after a chunk": b"5\r\nhelloXY3\r\nabc\r\n0\r\n\r\n",
    "trailer line": b"5\r\nhello\r\n0\r\nbad trailer line\r\n\r\n",
}


@pytest.mark.parametrize("broken", BROKEN_LATER)
@pytest.mark.parametrize("keyed", [True, False], ids=["governed", "pass-through"])
async def test_chunk_framing_broken_in_a_later_read_is_400_body_invalid(
    proxies: Proxies, keyed: bool, broken: str
) -> None:
    """A chunked body whose framing breaks after its head was taken: the client's error, `400
    body-invalid`, at once, and the connection closed (SPEC §8), where the parser reports it to
    the body's reader (aiohttp's Python parser). It was aiohttp's plain 500 with a traceback, or
    a pass-through's 502 blaming the upstream. aiohttp's C parser drops such a body without a
    word: docs/problems.md says what that costs (a 408, or the upstream's timeout)."""
    key = f"broken-later-{keyed}-{broken}".replace(" ", "-")
    head = b"POST /later HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n"
    if keyed:
        head += f"Idempotency-Key: {key}\r\n".encode()
    executed = len(proxies.ledger.executions)
    process = proxies.processes["python-parser"]
    logged = len(process.stderr())
    reader, writer = await asyncio.open_connection("127.0.0.1", process.port)
    began = time.monotonic()
    try:
        writer.write(head + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(BROKEN_LATER[broken])
        answer = await _collect(reader, idle=5.0)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:300]
    assert b"body-invalid" in answer and b"\r\nConnection: close\r\n" in answer
    assert time.monotonic() - began < 4.0
    assert len(proxies.ledger.executions) == executed
    await asyncio.sleep(0.3)  # what aiohttp would log once it lingered over the broken body
    since = process.stderr()[logged:]
    assert "Traceback" not in since and "Unhandled exception" not in since, since[-2000:]


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_valid_chunked_upload_behind_an_unfollowed_one_is_never_refused(
    proxies: Proxies, parser: str
) -> None:
    """A chunked request whose head came in two reads (its chunks are not followed) to a slow
    upstream, and behind it a valid chunked upload whose data holds a blank line, as every
    multipart part does: both run once and are answered 201. A walk begun in the wrong place
    once refused the second with 400 body-invalid."""
    first, second = f"unfollowed-1-{parser}", f"unfollowed-2-{parser}"
    reader, writer = await asyncio.open_connection("127.0.0.1", proxies.processes[parser].port)
    pieces: list[bytes | float] = [
        f"POST /one?delay=1.5 HTTP/1.1\r\nHost: p\r\nIdempotency-Key: {first}\r\n".encode(),
        0.2,
        b"Transfer-Encoding: chunked\r\n\r\n",
        0.2,
        b"5\r\nhello\r\n0\r\n\r\nPOST /two HTTP/1.1\r\nHost: p\r\n"
        + f"Idempotency-Key: {second}\r\nTransfer-Encoding: chunked\r\n\r\n".encode(),
        0.2,
        b"10\r\nab\r\n\r\n1",
        2.0,
        b"zzzzzzzzz\r\n",
        0.3,
        b"0\r\n\r\n",
    ]
    try:
        await _send(writer, pieces)
        answer = await _collect(reader, idle=3.0)
    finally:
        writer.close()
    assert answer.count(b"HTTP/1.1 201 Created") == 2, answer[:600]
    assert b" 400 " not in answer
    assert (proxies.ledger.count(first), proxies.ledger.count(second)) == (1, 1)


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_refusal_in_a_read_that_goes_on_with_a_head_is_closed(
    proxies: Proxies, parser: str
) -> None:
    """The read that ends a chunked body brings a next request's head but its blank line; the
    next brings that line, the request's body and a malformed request. The parser drops the
    whole request with the refused bytes: closed unanswered, never a 400 paired with it."""
    first, second = f"goes-on-1-{parser}", f"goes-on-2-{parser}"
    reader, writer = await asyncio.open_connection("127.0.0.1", proxies.processes[parser].port)
    pieces: list[bytes | float] = [
        f"POST /one?delay=1 HTTP/1.1\r\nHost: p\r\nIdempotency-Key: {first}\r\n".encode(),
        0.2,
        b"Transfer-Encoding: chunked\r\n\r\n",
        0.2,
        b"5\r\nhello\r\n0\r\n\r\nPOST /two HTTP/1.1\r\nHost: p\r\n"
        + f"Idempotency-Key: {second}\r\nContent-Length: 3\r\n".encode(),
        0.2,
        b"\r\nabcGET /three HTTP/1.1\r\nHost: p\r\nBad Header\r\n\r\n",
    ]
    try:
        await _send(writer, pieces)
        answer = await _collect(reader, idle=4.0)
    finally:
        writer.close()
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 201"), answer[:400]
    assert (proxies.ledger.count(first), proxies.ledger.count(second)) == (1, 0)


@pytest.mark.parametrize("parser", PARSERS)
async def test_the_clients_own_bytes_never_pick_the_problem_code(
    proxies: Proxies, parser: str
) -> None:
    """The C parser's message quotes the offending line: a chunk size spelled `zz-header` is a
    body's framing, not a header field, on both parsers alike."""
    answer = await exchange(
        proxies.processes[parser].port,
        b"POST /p HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\nzz-header\r\n",
    )
    assert b" 400 Bad Request\r\n" in answer.partition(b"\r\n")[0] + b"\r\n", answer[:200]
    assert b"header-invalid" not in answer


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_malformed_request_behind_empty_lines_gets_its_400(
    proxies: Proxies, parser: str
) -> None:
    """RFC 9112 §2.2: empty lines before a request begin nothing, so a refused request behind
    them on an idle connection is the read's only one: its 400, not a silent close."""
    answer = await exchange(proxies.processes[parser].port, b"\r\n\r\n" + BAD)
    assert answer.startswith((b"HTTP/1.1 400 Bad Request\r\n", b"HTTP/1.0 400 Bad Request\r\n"))


@pytest.mark.parametrize("parser", PARSERS)
async def test_a_governed_target_that_is_no_utf8_is_refused_before_any_claim(
    proxies: Proxies, parser: str
) -> None:
    """The C parser refuses such a target; the Python parser hands it on as surrogates, which
    no store can keep: the claim failed as `503 store-unavailable`, blaming a healthy store."""
    key = f"not-utf8-{parser}"
    jobs = await job_count(proxies.stores[parser])
    answer = await exchange(
        proxies.processes[parser].port,
        b"POST /\xff\xfe HTTP/1.1\r\nHost: p\r\nIdempotency-Key: "
        + key.encode()
        + b"\r\nContent-Length: 1\r\n\r\nx",
    )
    assert b" 400 Bad Request\r\n" in answer.partition(b"\r\n")[0] + b"\r\n", answer[:300]
    assert b"store-unavailable" not in answer
    assert proxies.ledger.count(key) == 0
    assert await job_count(proxies.stores[parser]) == jobs
