"""SIGTERM with clients on kept-alive connections (SPEC §3.2, §8), against a real process.

From the start of a drain the proxy claims nothing new: an idle kept-alive connection is closed
at once, a governed request that still reaches it (here, one whose body was on its way when the
drain began) gets `503 shutting-down` with `Retry-After` and `Connection: close` before any
claim, a duplicate held there is answered the same way at once, and a response finished during
the drain says `Connection: close`. Before the fix, kept-alive connections stayed open for the
whole `shutdown_timeout`: requests on them were claimed and forwarded (and cut off as `unknown`
at its end), and a held duplicate waited out the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from idemproxy.constants import ERROR_HEADER
from idemproxy.identity.intent import hash_credential
from idemproxy.store.factory import create_store
from tests.support.client import Answer, send

if TYPE_CHECKING:
    from .conftest import Backend, ProxyProcess, StartProxy

pytestmark = pytest.mark.slow

DRAIN = 3.0  # server.shutdown_timeout
AUTHORIZATION = "Bearer e2e-user"
OWNER = hash_credential(AUTHORIZATION)
ANSWER_LIMIT = 1.5  # seconds after SIGTERM: an answer now, not at the drain's end


@dataclass(frozen=True)
class Raw:
    status: int
    headers: dict[str, str]
    body: bytes


class Connection:
    """One kept-alive HTTP/1.1 connection, written and read by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, proxy: ProxyProcess) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", proxy.port))

    def head(self, key: str, path: str, length: int) -> None:
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: proxy\r\nAuthorization: {AUTHORIZATION}\r\n"
            f"Idempotency-Key: {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
        )

    async def post(self, key: str, path: str = "/charges", body: bytes = b"{}") -> Raw | None:
        self.head(key, path, len(body))
        self.writer.write(body)
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
        return await self.response()

    async def response(self, timeout: float = 5.0) -> Raw | None:
        """The next response, or None when the proxy closed the connection without one."""
        try:
            head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return Raw(int(status_line.split()[1]), headers, body)

    async def closed_by_proxy(self, timeout: float) -> bool:
        try:
            return await asyncio.wait_for(self.reader.read(1), timeout) == b""
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


@contextlib.asynccontextmanager
async def connections(proxy: ProxyProcess, count: int) -> AsyncIterator[list[Connection]]:
    opened = [await Connection.open(proxy) for _ in range(count)]
    try:
        yield opened
    finally:
        for connection in opened:
            await connection.close()


async def _in_background(session: aiohttp.ClientSession, url: str, key: str) -> Answer | None:
    """A request that keeps the proxy draining: its answer, or None when it was cut off."""
    try:
        return await send(session, url, key=key)
    except aiohttp.ClientError:
        return None


async def _start(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy
) -> tuple[ProxyProcess, str]:
    dsn = f"sqlite:///{tmp_path}/idemproxy.db"
    proxy = await start_proxy(
        "--upstream",
        backend.url,
        "--store",
        dsn,
        env={"IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": str(DRAIN)},
    )
    return proxy, dsn


async def _jobs(dsn: str, *keys: str) -> dict[str, object]:
    store = create_store(dsn)
    await store.open()
    try:
        return {key: await store.get(OWNER, key) for key in keys}
    finally:
        await store.close()


async def _until_claimed(dsn: str, key: str) -> None:
    until = time.monotonic() + 5.0
    while (await _jobs(dsn, key))[key] is None:
        assert time.monotonic() < until, f"{key} was never claimed"
        await asyncio.sleep(0.02)


async def _sigterm_until_draining(session: aiohttp.ClientSession, proxy: ProxyProcess) -> float:
    signalled = time.monotonic()
    os.kill(proxy.pid, signal.SIGTERM)
    until = signalled + 3.0
    while time.monotonic() < until:
        async with session.get(f"{proxy.admin_url}/readyz") as ready:
            if ready.status == 503:
                return signalled
        await asyncio.sleep(0.02)
    raise AssertionError(f"never draining: {proxy.describe()}")


def _refused_while_draining(answer: Raw) -> None:
    assert (answer.status, answer.headers.get(ERROR_HEADER.lower())) == (503, "shutting-down")
    assert answer.headers.get("retry-after") == "1"
    assert answer.headers.get("connection", "").lower() == "close"


async def test_idle_kept_alive_connections_are_closed_and_nothing_new_is_claimed(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy
) -> None:
    proxy, dsn = await _start(tmp_path, backend, start_proxy)
    async with aiohttp.ClientSession() as session, connections(proxy, 2) as (idle, sending):
        for number, connection in enumerate((idle, sending)):
            warm = await connection.post(f"warm-{number}")
            assert warm is not None and warm.status == 201  # and the connection is kept alive
        slow = asyncio.create_task(_in_background(session, proxy.url + "/charges?delay=4", "slow"))
        await _until_claimed(dsn, "slow")  # keeps the process draining

        signalled = await _sigterm_until_draining(session, proxy)
        # A client that had kept its connection sends its next request: refused or closed
        # now, not left without an answer until the process exits.
        late = await sending.post("late")
        assert time.monotonic() - signalled < ANSWER_LIMIT, "the late request waited"
        if late is not None:
            _refused_while_draining(late)
        assert await idle.closed_by_proxy(timeout=0.5), "the idle connection was kept open"
        assert time.monotonic() - signalled < ANSWER_LIMIT, "closed only at the drain's end"
        assert proxy.running, "the process was meant to still be draining"
        # Cut off at the drain's deadline: told so, not disconnected (SPEC §3.2).
        cut_off = await slow
        assert cut_off is not None, "disconnected without an answer"
        assert (cut_off.status, cut_off.error) == (504, "upstream-timeout")
    assert await proxy.wait_exit(DRAIN + 5.0) == 0, proxy.describe()
    assert (await _jobs(dsn, "late"))["late"] is None, "claimed during the drain"
    assert backend.ledger.count("late") == 0


async def test_a_request_whose_body_arrives_during_the_drain_is_refused_before_its_claim(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy
) -> None:
    proxy, dsn = await _start(tmp_path, backend, start_proxy)
    body = b'{"amount": 100}'
    async with aiohttp.ClientSession() as session, connections(proxy, 1) as (midway,):
        finishing = asyncio.create_task(
            _in_background(session, proxy.url + "/charges?delay=1.2", "finishing")
        )
        await _until_claimed(dsn, "finishing")
        midway.head("midway", "/charges", len(body))
        midway.writer.write(body[:5])
        await asyncio.sleep(0.2)  # its head was read: the request is being handled

        signalled = await _sigterm_until_draining(session, proxy)
        midway.writer.write(body[5:])
        refused = await midway.response()
        assert refused is not None, f"cut off without an answer: {proxy.describe()}"
        _refused_while_draining(refused)
        assert time.monotonic() - signalled < ANSWER_LIMIT

        finished = await finishing  # done within the drain: answered, then the connection closes
        assert finished is not None and finished.status == 201
        assert finished.headers.get("Connection", "").lower() == "close"
    assert await proxy.wait_exit(DRAIN + 5.0) == 0, proxy.describe()
    assert (await _jobs(dsn, "midway"))["midway"] is None
    assert backend.ledger.count("midway") == 0


async def test_a_duplicate_held_on_a_draining_proxy_is_answered_at_once(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy
) -> None:
    proxy, dsn = await _start(tmp_path, backend, start_proxy)
    path = "/charges?delay=4"  # longer than the drain: cut off at its end
    async with aiohttp.ClientSession() as session, connections(proxy, 1) as (held,):
        first = asyncio.create_task(_in_background(session, proxy.url + path, "held"))
        await _until_claimed(dsn, "held")
        duplicate = asyncio.create_task(held.post("held", path, b'{"amount": 100}'))
        await asyncio.sleep(0.3)
        assert not duplicate.done()  # held behind the attempt in flight

        signalled = await _sigterm_until_draining(session, proxy)
        answer = await duplicate
        assert answer is not None, "disconnected without an answer"
        _refused_while_draining(answer)
        assert time.monotonic() - signalled < ANSWER_LIMIT
        await first
    assert await proxy.wait_exit(DRAIN + 5.0) == 0, proxy.describe()


@pytest.mark.parametrize("key", ["begun", None], ids=["governed", "pass-through"])
async def test_a_request_whose_head_began_before_the_drain_gets_its_answer(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy, key: str | None
) -> None:
    """Nothing else in flight: the drain waits for a head that began before it, and the
    request it brings is answered (refused, if governed) before the connection closes."""
    proxy, dsn = await _start(tmp_path, backend, start_proxy)
    key_line = f"Idempotency-Key: {key}\r\n" if key is not None else ""
    head = (
        f"POST /charges HTTP/1.1\r\nHost: proxy\r\nAuthorization: {AUTHORIZATION}\r\n{key_line}"
        "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    ).encode()
    async with aiohttp.ClientSession() as session, connections(proxy, 1) as (begun,):
        warm = await begun.post("warm")
        assert warm is not None and warm.status == 201
        begun.writer.write(head[:20])
        await begun.writer.drain()
        await asyncio.sleep(0.2)  # the proxy has read the head's first bytes

        signalled = await _sigterm_until_draining(session, proxy)
        assert proxy.running
        begun.writer.write(head[20:])
        answer = await begun.response()
        assert answer is not None, f"closed without an answer: {proxy.describe()}"
        assert time.monotonic() - signalled < ANSWER_LIMIT
        assert answer.headers.get("connection", "").lower() == "close"
        if key is not None:
            _refused_while_draining(answer)
        else:
            assert answer.status == 201, answer
        assert await begun.closed_by_proxy(timeout=1.0)
    assert await proxy.wait_exit(DRAIN + 5.0) == 0, proxy.describe()
    if key is not None:
        assert (await _jobs(dsn, key))[key] is None, "claimed during the drain"
        assert backend.ledger.count(key) == 0


CHUNKED_HEAD = b"PUT /things HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "reads",
    [
        # The head in two reads, its body in a third.
        [CHUNKED_HEAD[:24], CHUNKED_HEAD[24:], b"3\r\nabc\r\n0\r\n\r\n"],
        # The head in three reads, the second with the start of the body.
        [CHUNKED_HEAD[:10], CHUNKED_HEAD[10:40], CHUNKED_HEAD[40:] + b"3\r\na", b"bc\r\n0\r\n\r\n"],
    ],
    ids=["head-in-two-reads", "head-in-three-reads"],
)
async def test_a_connection_idle_after_a_chunked_upload_closes_at_once_and_the_drain_ends(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy, reads: list[bytes]
) -> None:
    """A chunked body whose head came in more than one read was not followed to its end: its
    connection was marked as holding a next request, so a drain with nothing in flight waited
    for it until its deadline, and the idle connection was not closed."""
    proxy, _ = await _start(tmp_path, backend, start_proxy)
    async with connections(proxy, 1) as (uploaded,):
        for read in reads:
            uploaded.writer.write(read)
            await uploaded.writer.drain()
            await asyncio.sleep(0.1)
        answer = await uploaded.response()
        assert answer is not None and answer.status == 201, answer
        assert answer.headers.get("connection", "").lower() != "close"

        signalled = time.monotonic()
        os.kill(proxy.pid, signal.SIGTERM)
        assert await uploaded.closed_by_proxy(timeout=1.0), "the idle connection was kept open"
        assert await proxy.wait_exit(DRAIN) == 0, proxy.describe()
        assert time.monotonic() - signalled < ANSWER_LIMIT, "the drain waited for nothing"


@pytest.mark.parametrize(
    "behind",
    [
        b"PUT /b HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"PUT /b HTTP/1.1\r\nHost: proxy\r\nContent-Length: 8\r\n\r\nab\n0\r\n\r\n",
        b"GET /b HTTP/1.1\r\nHost: proxy\r\n\r\n",
    ],
    ids=["empty-chunked", "ends-like-chunks", "get"],
)
async def test_a_request_pipelined_behind_a_chunked_upload_is_answered_through_a_drain(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy, behind: bytes
) -> None:
    """More chunks in one read than are followed: where the body ends is not known, nor
    whether a request follows it, even one that ends as chunks do. The connection is not taken
    for idle then (at worst a drain waits for it until its deadline): a request sent behind
    the upload, with a drain beginning as the first answer arrives, is answered."""
    proxy, _ = await _start(tmp_path, backend, start_proxy)
    async with connections(proxy, 1) as (uploaded,):
        uploaded.writer.write(CHUNKED_HEAD)
        await uploaded.writer.drain()
        await asyncio.sleep(0.1)
        uploaded.writer.write(b"1\r\na\r\n" * 300 + b"0\r\n\r\n" + behind)
        await uploaded.writer.drain()
        first = await uploaded.response()
        assert first is not None and first.status == 201, first
        os.kill(proxy.pid, signal.SIGTERM)
        if first.headers.get("connection", "").lower() != "close":
            second = await uploaded.response(timeout=DRAIN + 2.0)
            assert second is not None, f"closed without an answer: {proxy.describe()}"
            assert second.status in (201, 404), second
        assert await proxy.wait_exit(DRAIN + 3.0) == 0, proxy.describe()


async def test_a_head_begun_behind_many_chunks_in_the_same_read_is_answered_through_a_drain(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy
) -> None:
    """The head, more chunks than are followed and the start of a next head in one read: the
    connection was taken for idle, closed at once by a drain, and the next request was never
    answered (nor given its head deadline)."""
    proxy, _ = await _start(tmp_path, backend, start_proxy)
    async with aiohttp.ClientSession() as session, connections(proxy, 1) as (uploaded,):
        next_head = b"GET /after HTTP/1.1\r\nHost: proxy\r\n\r\n"
        uploaded.writer.write(CHUNKED_HEAD + b"1\r\na\r\n" * 300 + b"0\r\n\r\n" + next_head[:25])
        await uploaded.writer.drain()
        first = await uploaded.response()
        assert first is not None and first.status == 201, first

        signalled = await _sigterm_until_draining(session, proxy)
        uploaded.writer.write(next_head[25:])
        answer = await uploaded.response()
        assert answer is not None, f"closed without an answer: {proxy.describe()}"
        assert answer.headers.get("connection", "").lower() == "close"
        assert time.monotonic() - signalled < ANSWER_LIMIT
    assert await proxy.wait_exit(DRAIN + 5.0) == 0, proxy.describe()
