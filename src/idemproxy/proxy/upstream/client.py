"""The upstream client (SPEC §10): pooled keep-alive, no decompression, no silent re-sends.

This module is the one boundary where the upstream leg's errors become `UpstreamFailure`: the
client's interface first, then its HTTP/1.1 connections, the pool and the answer's parsing. The
request's head is written here (`request_head`) and the answer read here, so one exchange with
the upstream is read in one file.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import os
import re
import select
import socket
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from idemproxy.core.machine import Failure
from idemproxy.http.deadline import Deadline
from idemproxy.proxy.upstream.dial import Dialing, Origin

# Flow control of a streamed response body: stop reading the upstream above HIGH buffered
# bytes, resume below LOW (as aiohttp's StreamReader does with its 64 KiB limit x 2).
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024
# Bytes received before a response head is whole: 128 fields of 8 KiB (aiohttp's limits) plus
# one read's worth of body behind the head.
MAX_HEAD_BYTES = 128 * 8 * 1024 + 256 * 1024
ONE_WRITE = 16 * 1024  # up to this size head and body are joined into one write
# RFC 9110 §5.5: a field value is VCHAR, SP, HTAB and obs-text (0x80-0xFF); any other control
# character makes it invalid. NUL, CR and LF make the whole message invalid ("MUST reject").
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_FATAL_CONTROL = re.compile(rb"[\x00\r\n]")
# The fields that frame the body: one with any control character is refused, never left out
# (llhttp would frame the body by what is left, a peer of the upstream by something else).
_FRAMING_FIELDS = frozenset({b"content-length", b"transfer-encoding"})
# OpenSSL's reasons for an alert received about the client's certificate (RFC 8446 §6.2).
_HANDSHAKE_ALERTS = frozenset(
    {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_REVOKED",
        "SSLV3_ALERT_CERTIFICATE_EXPIRED",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "TLSV1_ALERT_UNKNOWN_CA",
        "TLSV1_ALERT_ACCESS_DENIED",
        "SSLV3_ALERT_HANDSHAKE_FAILURE",
    }
)


@dataclass(frozen=True, slots=True)
class UpstreamHooks:
    """What the client reports to the rest of the process."""

    # Test-only (proxy/failpoints.py): called once a request's bytes are on the wire.
    on_sent: Callable[[], None] | None = None
    # on_headers_dropped(n): n fields of a response head were left out (SPEC §10).
    on_headers_dropped: Callable[[int], None] | None = None


NO_HOOKS = UpstreamHooks()


@dataclass(frozen=True, slots=True)
class Link:
    """What every exchange of an open client shares."""

    pool: ConnectionPool
    connect_timeout: float
    hooks: UpstreamHooks


class StreamedBody(NamedTuple):
    """A request body sent as it comes: with its declared length, or chunked (`length` None,
    as client.py's `framing_for` chose)."""

    chunks: AsyncIterable[bytes]
    length: int | None


class UpstreamFailure(Exception):
    """The upstream call failed; `failure` says how far the request got (SPEC §3.2)."""

    def __init__(
        self, failure: Failure, reason: str, *, client_body: Exception | None = None
    ) -> None:
        super().__init__(reason)
        self.failure = failure
        self.reason = reason
        # What the client's own body raised while it streamed upstream (a pass-through): the
        # caller tells the client's error (its framing broke) from the upstream's.
        self.client_body = client_body


class _Stage(enum.Enum):
    HEAD = 1  # waiting for the response head
    BODY = 2  # the head arrived; body bytes may follow
    DONE = 3  # the whole message arrived


class UpstreamResponse:
    """One exchange on one connection: the response head, then its body as it arrives.

    It is its own llhttp parser's protocol (httptools calls its `on_*` methods): one parser per
    exchange, so that each callback is one call into the exchange, not a call into the
    connection handed on to it."""

    def __init__(self, connection: Connection, method: str, timeout: float) -> None:
        self.parser = httptools.HttpResponseParser(self)
        # The leniencies aiohttp's client applies to responses, so that backends it accepted
        # (bare LF line ends, obs-fold, spaces after a chunk size) keep working; values are
        # still checked for control characters (`on_header`).
        self.parser.set_dangerous_leniencies(
            lenient_headers=True,
            lenient_optional_cr_before_lf=True,
            lenient_spaces_after_chunk_size=True,
        )
        self._connection = connection
        self._loop = connection.loop
        self._timeout = timeout
        self.method = method
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.content_length: int | None = None
        self._raw_headers: list[tuple[str, str]] = []
        # Names of fields left out for a control character in their value (`on_header`).
        self.dropped_headers: list[str] = []
        self._reason_bytes = b""
        self.stage = _Stage.HEAD  # read by the connection for every read of the upstream
        self._interim = False
        self._until_close = False  # the body ends when the upstream closes the connection
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._error: UpstreamFailure | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._waiting_for = ""  # what a timeout of the current wait is reported as
        self.request_sent = False
        self.head_bytes = 0  # received while the head was incomplete (MAX_HEAD_BYTES)
        self.finished_at: float | None = None  # time.perf_counter() when the body was whole

    # --- reading, for the proxy -------------------------------------------------------------

    async def wait_head(self) -> None:
        # `_wait`, in place: nearly every head comes in one read, so this waits once.
        while self.stage is _Stage.HEAD:
            if self._error is not None:
                raise self._error
            waiter = self._waiter = self._loop.create_future()
            self._waiting_for = "upstream timed out"
            deadline = self._connection.deadline
            due = deadline.time() + self._timeout
            if deadline.armed <= due:  # its timer checks by then: a field (http/deadline.py)
                deadline.due = due
            else:
                deadline.start(self._timeout)
            try:
                await waiter
            finally:
                deadline.due = None
                self._waiter = None

    async def read_chunk(self) -> bytes:
        """The next piece of the body; b"" once it is complete."""
        while True:
            if self._chunks:
                return self._take()
            if self._error is not None:
                raise self._error
            if self.stage is _Stage.DONE:
                return b""
            await self._wait("upstream body timed out")

    async def read_piece(self) -> tuple[bytes, bool]:
        """`read_chunk`, and whether the body ended with that piece: a reader of the whole
        body (a capture) makes no read past its end, where nearly every body is one piece."""
        while True:
            if self._chunks:
                chunk = self._take()
                return chunk, not self._chunks and self.stage is _Stage.DONE
            if self._error is not None:
                raise self._error
            if self.stage is _Stage.DONE:
                return b"", True
            await self._wait("upstream body timed out")

    def _take(self) -> bytes:
        """The first piece buffered; reading from the upstream again once below the low water."""
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered < _LOW_WATER:
            self._paused = False
            self._connection.resume_reading()
        return chunk

    @property
    def complete(self) -> bool:
        return self.stage is _Stage.DONE

    @property
    def ended(self) -> bool:
        """Whole, or failed: nothing more it is sent changes what it is."""
        return self.stage is _Stage.DONE or self._error is not None

    @property
    def awaiting_head(self) -> bool:
        return self.stage is _Stage.HEAD

    async def _wait(self, reason: str) -> None:
        """Wait for the upstream, at most `timeout` (SPEC §3.2: a timeout is unknown)."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        self._waiting_for = reason
        deadline = self._connection.deadline
        due = deadline.time() + self._timeout
        if deadline.armed <= due:  # as in `wait_head`
            deadline.due = due
        else:
            deadline.start(self._timeout)
        try:
            await waiter
        finally:
            deadline.due = None
            self._waiter = None

    def expire(self) -> None:
        """The connection's deadline passed while this exchange waited."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self.fail(UpstreamFailure(Failure.TIMEOUT, self._waiting_for))
            self._connection.abort()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: UpstreamFailure) -> None:
        if self.stage is not _Stage.DONE and self._error is None:
            self._error = error
        self._wake()

    def spent(self) -> None:
        """The exchange is over (its connection went back to the pool or was closed). The
        parser's callbacks are this object's bound methods, a reference cycle: dropping the
        parser lets reference counting free both now, where the cyclic collector would walk
        every finished exchange later (about 5 µs per request at c=32, docs/benchmarks.md).
        Its failure goes too: raised through the frames that waited for it, it holds them in
        its traceback, this exchange among their locals, and with them the request they sent
        (a spooled body's open file) until that collector ran."""
        del self.parser
        self._error = None

    # --- llhttp callbacks (httptools) -------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.stage is _Stage.DONE:
            # A second message after the answer (a body longer than declared, a forged
            # response): never parsed into this exchange, and the connection is not reused.
            raise ConnectionAbortedError("bytes after the upstream's response")

    def on_status(self, reason: bytes) -> None:
        self._reason_bytes += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        # As aiohttp's parser does: llhttp keeps the whitespace after a value (RFC 9110 §5.5),
        # and in lenient mode lets control characters through, which would reach the client.
        value = value.rstrip(b" \t")
        if _CONTROL.search(value) is not None:
            if _FATAL_CONTROL.search(value) or name.lower() in _FRAMING_FIELDS:
                raise ValueError("a control character in an upstream header")  # SPEC §10
            # SPEC §10: invalid, but harmless to the framing; refusing the response would turn
            # an executed request into an unknown outcome. The field is dropped and counted.
            self.dropped_headers.append(name.decode("latin-1"))
            return
        # Decoded as aiohttp decodes request headers: UTF-8, any other byte as a surrogate
        # escape. The proxy writes such a value back with the same codec
        # (proxy/server/connection.py) and stores it losslessly (store/rows.py): obs-text passes
        # byte for byte (SPEC §7).
        self._raw_headers.append(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # RFC 9110 §15.2: interim responses (103 Early Hints, an unasked-for 100) are not
            # the answer; the final response follows on the same connection.
            self._interim = True
            self._raw_headers = []
            self.dropped_headers = []
            self._reason_bytes = b""
            return
        self.status = status
        reason = self._reason_bytes
        # RFC 9112 §4: the reason phrase is informational; one with a control character is not
        # forwarded (the client gets an empty one), any other byte goes out as it came.
        self.reason = "" if _CONTROL.search(reason) else reason.decode("utf-8", "surrogateescape")
        headers = CIMultiDict(self._raw_headers)
        self.headers = CIMultiDictProxy(headers)
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        bodiless = self.method == "HEAD" or status in (204, 304)
        # `framing_fault` finds none without a Transfer-Encoding (most answers).
        fault = (
            None
            if bodiless or "Transfer-Encoding" not in headers
            else framing_fault(headers, self.parser.get_http_version())
        )
        if fault is not None:
            # SPEC §10: a malformed response (unknown once sent); raised while the head is not
            # yet the exchange's, so that no path relays it.
            raise ValueError(fault)
        self.stage = _Stage.BODY
        if bodiless:
            self._done()  # RFC 9110 §6.4.1: no body, whatever the headers say
            return
        if length is None and not _chunked(headers):
            self._until_close = True  # RFC 9112 §6.3 (4, 7): read until the connection closes
        waiter = self._waiter  # `_wake`, written out here and below: once per read of a body
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.stage is _Stage.DONE:
            # After a bodiless answer: llhttp, not told the request was a HEAD, reads on the
            # body its Content-Length announced. Relayed, those bytes would be taken as the
            # start of the client's next answer (RFC 9110 §9.3.2: a HEAD answer ends with its
            # head); the connection is not reused after a HEAD (`release`).
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if not self._paused and self._buffered > _HIGH_WATER:
            self._paused = True
            self._connection.pause_reading()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_message_complete(self) -> None:
        # Read here: llhttp resets the message's flags once this callback returns.
        self._connection.keep_alive = self.parser.should_keep_alive()
        if self._interim:
            self._interim = False
            return
        # `_done`, in place: every exchange ends here.
        if self.stage is not _Stage.DONE:
            self.stage = _Stage.DONE
            self.finished_at = time.perf_counter()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _done(self) -> None:
        if self.stage is not _Stage.DONE:
            self.stage = _Stage.DONE
            self.finished_at = time.perf_counter()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_connection_lost(self, exc: BaseException | None) -> None:
        if self.stage is _Stage.BODY and self._until_close and exc is None:
            self._done()  # a close-delimited body ends here
            return
        # Only on a connection's first exchange: the handshake is long done on a reused one.
        first = self.head_bytes == 0 and self._connection.fresh
        refusal = _handshake_refusal(exc) if first else None
        if refusal is not None and self.stage is _Stage.HEAD:
            self.fail(
                UpstreamFailure(Failure.CONNECT, f"upstream refused the TLS handshake: {refusal}")
            )
        elif self.request_sent or self.stage is not _Stage.HEAD:
            self.fail(UpstreamFailure(Failure.BROKEN, "upstream closed the connection"))
        else:
            self.fail(UpstreamFailure(Failure.BROKEN, "upstream closed before the request"))
        self._wake()


def _handshake_refusal(exc: BaseException | None) -> str | None:
    """The alert, when `exc` is the upstream refusing this client's certificate (or its lack).

    With TLS 1.3 the client's handshake ends before the server has checked the client's
    certificate (RFC 8446 §4.4.2): a server that refuses it answers the request's first bytes
    with this alert, having decrypted none of them, so nothing was executed (SPEC §3.2). Only
    certificate and handshake alerts count: no server sends one once its handshake is done.
    """
    if isinstance(exc, ssl.SSLError) and exc.reason in _HANDSHAKE_ALERTS:
        return str(exc.reason)
    return None


# A read of what arrived before a connection broke (`Connection._read_what_arrived`).
_READ_LEFT = 64 * 1024


class Connection(asyncio.Protocol):
    """One keep-alive connection; carries one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.exchange: UpstreamResponse | None = None
        self.closed = False
        self.keep_alive = False
        self.idle_since = 0.0
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        # The exchange's current wait for the upstream (http/deadline.py: one timer).
        self.deadline = Deadline(loop, self._expire_exchange)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport has every method of asyncio.Transport but is no subclass.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None or exchange.stage is _Stage.DONE:
            self.abort()  # bytes nobody asked for: this connection can not be trusted again
            return
        if exchange.stage is _Stage.HEAD:
            # llhttp sets no limit on a response head; aiohttp's parser allowed 128 fields of
            # 8 KiB. Past this much without a whole head, the upstream is broken.
            exchange.head_bytes += len(data)
            if exchange.head_bytes > MAX_HEAD_BYTES:
                exchange.fail(UpstreamFailure(Failure.BROKEN, "upstream response head too large"))
                self.abort()
                return
        try:
            exchange.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            exchange.fail(UpstreamFailure(Failure.BROKEN, "upstream switched protocols"))
            self.abort()
        except httptools.HttpParserError as exc:
            # A callback's refusal (on_header, on_headers_complete) says why; llhttp does not.
            why = exc.__context__ if isinstance(exc.__context__, ValueError) else exc
            exchange.fail(UpstreamFailure(Failure.BROKEN, f"invalid upstream response: {why}"))
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost settles the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.deadline.close()
        exchange = self.exchange
        if exchange is not None:
            if exc is not None and exchange.stage is not _Stage.DONE:
                self._read_what_arrived()
            exchange.on_connection_lost(exc)
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_exception(ConnectionResetError("upstream closed the connection"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _read_what_arrived(self) -> None:
        """What the upstream sent before its connection broke, still in the socket's buffer.

        RFC 9112 §9.6: a server may answer before it has read the whole request body (a 413
        from a size limit, a 401 from an authentication layer) and close; closing with the body
        unread sends a reset. A write of the rest of the body then fails at once, and the loop
        closes the transport without reading the answer that arrived before the reset: the
        exchange would be a reset after sending (`unknown`, SPEC §3.2) where the upstream
        answered. The bytes are read here, before the transport closes the socket, from a
        duplicate of its descriptor (the transports have no public read). A TLS connection's
        bytes are records its transport has not decrypted: left as they are."""
        transport = self.transport
        if transport is None or transport.get_extra_info("sslcontext") is not None:
            return
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        try:
            with socket.socket(fileno=os.dup(sock.fileno())) as duplicate:
                duplicate.setblocking(False)
                while self.exchange is not None and not self.exchange.ended:
                    data = duplicate.recv(_READ_LEFT)
                    if not data:
                        break
                    self.data_received(data)
        except OSError:  # nothing more to read (EAGAIN), or the reset itself
            return

    # for the exchange and the pool
    def _expire_exchange(self) -> None:
        if self.exchange is not None:
            self.exchange.expire()

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            raise ConnectionResetError("upstream connection closed")
        self.transport.write(data)

    def writelines(self, data: Iterable[bytes]) -> None:
        if self.closed or self.transport is None:
            raise ConnectionResetError("upstream connection closed")
        self.transport.writelines(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("upstream connection closed")
        if self._write_paused:
            self._drained = self.loop.create_future()
            try:
                await self._drained
            finally:
                self._drained = None

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def readable(self) -> bool:
        """Whether an idle connection has something to read: its peer's close (or bytes nobody
        asked for) that the loop has not handled yet. Reusing it would send a request into a
        closing connection, and its outcome would be unknown (SPEC §3.2); a poll with no wait
        narrows that race to the network's own delay, as urllib3 does."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return True
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
        return bool(poller.poll(0))

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    @property
    def fresh(self) -> bool:
        """No exchange ran on this connection before the current one (it never idled)."""
        return self.idle_since == 0.0


class Dialer(Protocol):
    """How connections to one origin are opened (proxy/upstream/dial.py)."""

    async def connect(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        protocol: Callable[[], Connection],
    ) -> Connection: ...


class ConnectionPool:
    """Idle keep-alive connections per origin (newest first) and a limit on those in use."""

    def __init__(self, *, limit: int, keepalive: float, dialer: Callable[[Origin], Dialer]) -> None:
        self._limit = limit
        self._keepalive = keepalive
        self._dialer = dialer
        self._idle: dict[Origin, list[Connection]] = {}
        self._in_use = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closing = False
        self._sweeper: asyncio.TimerHandle | None = None

    async def acquire(self, origin: Origin, connect_timeout: float) -> Connection:
        """A connection to `origin`; any failure here means nothing was sent (SPEC §3.2)."""
        loop = asyncio.get_running_loop()
        if self._in_use < self._limit:  # the common case, with no timer to arm
            idle = self._idle_connection(origin, loop.time())
            if idle is not None:
                self._in_use += 1
                return idle
        try:
            async with asyncio.timeout(connect_timeout):
                while self._in_use >= self._limit:
                    waiter = loop.create_future()
                    self._waiters.append(waiter)
                    try:
                        await waiter
                    finally:
                        with contextlib.suppress(ValueError):
                            self._waiters.remove(waiter)
                self._in_use += 1
                try:
                    return self._idle_connection(origin, loop.time()) or await self._connect(
                        loop, origin
                    )
                except BaseException:
                    self._give_back()
                    raise
        except TimeoutError as exc:
            raise UpstreamFailure(Failure.CONNECT, "connect failed: timed out") from exc
        except OSError as exc:
            raise UpstreamFailure(Failure.CONNECT, f"connect failed: {exc}") from exc

    def release(self, origin: Origin, connection: Connection) -> None:
        exchange = connection.exchange
        connection.exchange = None
        if exchange is not None:
            exchange.spent()
        # Kept for the next exchange only after a whole answer to a whole request, on a
        # connection both sides keep alive.
        reusable = (
            self._keepalive > 0
            and not connection.closed
            and exchange is not None
            and exchange.stage is _Stage.DONE
            and exchange.request_sent
            and exchange.method != "HEAD"  # llhttp would wait for the body HEAD announced
            and connection.keep_alive
        )
        if reusable and not self._closing:
            connection.idle_since = asyncio.get_running_loop().time()
            self._idle.setdefault(origin, []).append(connection)
            if self._sweeper is None:
                self._schedule_sweep()
        else:
            connection.abort()
        self._in_use -= 1
        if self._waiters:
            self._wake_waiter()

    def close(self) -> None:
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for idle in self._idle.values():
            for connection in idle:
                connection.abort()
        self._idle.clear()

    def _idle_connection(self, origin: Origin, now: float) -> Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue  # the upstream closed it while it idled
            if now - connection.idle_since < self._keepalive and not connection.readable():
                return connection
            for stale in (*idle, connection):  # older ones idled longer still
                stale.abort()
            idle.clear()
        return None

    def _sweep_idle(self) -> None:
        """Close connections idle for longer than `keepalive` (aiohttp's keepalive_timeout)."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for idle in self._idle.values():
            fresh = [c for c in idle if not c.closed and now - c.idle_since < self._keepalive]
            for connection in idle:
                if connection not in fresh:
                    connection.abort()
            idle[:] = fresh
        self._schedule_sweep()

    def _schedule_sweep(self) -> None:
        if self._sweeper is None and any(self._idle.values()) and not self._closing:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self._keepalive, self._sweep_idle)

    async def _connect(self, loop: asyncio.AbstractEventLoop, origin: Origin) -> Connection:
        host, port, _ = origin
        return await self._dialer(origin).connect(loop, host, port, lambda: Connection(loop))

    def _give_back(self) -> None:
        self._in_use -= 1
        self._wake_waiter()

    def _wake_waiter(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class Exchange:
    """One request and its response on a pooled connection, as `UpstreamClient.request`
    prepared it. A class rather than a generator context manager: it
    runs for every request, and a generator's frame and its `asynccontextmanager` wrapper cost
    more than the two methods."""

    __slots__ = (
        "_body",
        "_connection",
        "_head",
        "_link",
        "_method",
        "_origin",
        "_sender",
        "_timeout",
    )

    def __init__(
        self,
        link: Link,
        origin: Origin,
        method: str,
        head: bytes,
        body: bytes | StreamedBody | None,
        timeout: float,
    ) -> None:
        self._link = link
        self._timeout = timeout
        self._origin = origin
        self._method = method
        self._head = head
        self._body = body
        self._connection: Connection | None = None
        self._sender: asyncio.Task[None] | None = None

    async def open(self) -> UpstreamResponse:
        """Send the request and wait for the response's head."""
        link = self._link
        connection = await link.pool.acquire(self._origin, link.connect_timeout)
        self._connection = connection
        exchange = UpstreamResponse(connection, self._method, self._timeout)
        connection.exchange = exchange
        body = self._body
        try:
            if body is None or isinstance(body, bytes | bytearray):
                whole = bytes(body or b"")
                if len(whole) <= ONE_WRITE:
                    connection.write(self._head + whole)
                else:
                    connection.writelines((self._head, whole))
                exchange.request_sent = True
                if link.hooks.on_sent is not None:
                    connection.loop.call_soon(link.hooks.on_sent)
            else:
                connection.write(self._head)
                self._sender = asyncio.create_task(
                    send_stream(
                        connection,
                        exchange,
                        body.chunks,
                        content_length=body.length,
                        on_sent=link.hooks.on_sent,
                    )
                )
            await exchange.wait_head()
        except BaseException as exc:
            await self.close()
            if isinstance(exc, ConnectionError | OSError):
                raise UpstreamFailure(Failure.BROKEN, f"upstream connection broke: {exc}") from exc
            raise
        if exchange.dropped_headers:
            self._report_dropped(exchange.dropped_headers)
        return exchange

    __aenter__ = open

    def _report_dropped(self, names: list[str]) -> None:
        host, port, _ = self._origin
        # Names only: a value may be anything, and is what made the field invalid.
        log.warning(
            "upstream %s:%d sent a control character in header(s) %s: left out (SPEC §10)",
            host,
            port,
            ", ".join(names),
        )
        on_dropped = self._link.hooks.on_headers_dropped
        if on_dropped is not None:
            on_dropped(len(names))

    async def close(self, *_exc: object) -> None:
        """The connection goes back to the pool, or is closed when it cannot serve again."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        sender = self._sender
        if sender is not None and not sender.done():
            sender.cancel()  # answered before the whole body was sent: not reusable
            connection.abort()
        self._link.pool.release(self._origin, connection)

    __aexit__ = close


async def send_stream(
    connection: Connection,
    exchange: UpstreamResponse,
    body: AsyncIterable[bytes],
    *,
    content_length: int | None,
    on_sent: Callable[[], None] | None,
) -> None:
    """Stream a request body upstream, in step with the connection's write buffer: chunked
    when it has no declared length (client.py `framing_for`)."""
    chunked = content_length is None
    sent = 0
    chunks = aiter(body)
    try:
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except Exception as exc:  # the client's own body broke off, or it hung up
                reason = f"request body broke off: {exc!r}"
                exchange.fail(UpstreamFailure(Failure.BROKEN, reason, client_body=exc))
                connection.abort()
                return
            if not chunk:
                continue
            sent += len(chunk)
            if chunked:
                connection.writelines((f"{len(chunk):x}\r\n".encode(), chunk, b"\r\n"))
            else:
                connection.write(chunk)
            if on_sent is not None:
                connection.loop.call_soon(on_sent)
                on_sent = None
            await connection.drain()
        if chunked:
            connection.write(b"0\r\n\r\n")
        elif content_length is not None and sent != content_length:
            raise ConnectionResetError("request body ended before its declared length")
        exchange.request_sent = True
    except (ConnectionError, OSError) as exc:  # the upstream's side
        exchange.fail(UpstreamFailure(Failure.BROKEN, f"sending the request failed: {exc}"))
        connection.abort()


def transfer_codings(headers: CIMultiDict[str] | CIMultiDictProxy[str]) -> list[str]:
    """The transfer codings of every Transfer-Encoding line, in the order they were applied."""
    return [
        coding.strip().lower()
        for value in headers.getall("Transfer-Encoding", ())
        for coding in value.split(",")
        if coding.strip()
    ]


def framing_fault(headers: CIMultiDict[str], version: str) -> str | None:
    """Why a response's Transfer-Encoding makes it malformed for the proxy, or None.

    The proxy decodes one transfer coding, `chunked`, and relays, stores and replays the decoded
    bytes as the identity body (SPEC §10). Any other coding (gzip, deflate, compress, an unknown
    one, `identity`, which RFC 9112 §7 no longer defines, or a second `chunked`, which §7.1
    forbids) leaves bytes whose meaning is not the identity body: relaying them as such would
    change what the upstream said, so the response is refused as malformed (RFC 9112 §6.1).
    So is a Transfer-Encoding on a 1.0 response (§6.1: "MUST treat the message as if the
    framing is faulty") and one beside a Content-Length (§6.3 (3): "ought to be handled as an
    error").
    """
    if "Transfer-Encoding" not in headers:
        return None
    if version != "1.1":
        return f"Transfer-Encoding in an HTTP/{version} response"
    codings = transfer_codings(headers)
    if codings != ["chunked"]:
        return f"transfer codings the proxy does not decode: {', '.join(codings) or 'none'}"
    if "Content-Length" in headers:
        return "Transfer-Encoding and Content-Length in one response"
    return None


def _chunked(headers: CIMultiDict[str]) -> bool:
    """RFC 9112 §6.3 (4): chunked framing only when `chunked` is the final coding, across every
    Transfer-Encoding line. As llhttp frames the body; the first line alone (`chunked`, then
    `identity`) disagreed with it and failed a close-delimited body as a cut-off one."""
    codings = transfer_codings(headers)
    return bool(codings) and codings[-1] == "chunked"


log = logging.getLogger(__name__)
_DEFAULT_PORTS = {"http": 80, "https": 443}
# aiohttp's client sends `Content-Length: 0` for a body-less request of any other method.
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"})
# Set by this client from the request itself; a caller's copies are dropped.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding"})


class UpstreamClient:
    def __init__(
        self,
        *,
        timeout: float,
        connect_timeout: float,
        connections: int,
        keepalive: float,
        hooks: UpstreamHooks = NO_HOOKS,
        dialing: Dialing | None = None,
    ) -> None:
        """`dialing`: TLS and egress proxies per origin (`Dialing.from_settings`); by default
        every origin is reached directly, an https one verified against the system's CAs."""
        self._dialing = dialing or Dialing()
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._connections = connections
        self._keepalive = keepalive
        # `keepalive` 0: no connection is reused, and the upstream is told so (RFC 9112 §9.6).
        self._closing_each = "Connection: close\r\n" if keepalive == 0 else ""
        self._hooks = hooks
        self._link: Link | None = None
        self._origins: dict[tuple[str | None, str | None, int | None], tuple[Origin, str]] = {}

    async def open(self) -> None:
        pool = ConnectionPool(
            limit=self._connections, keepalive=self._keepalive, dialer=self._dialing.dialer
        )
        self._link = Link(pool, self._connect_timeout, self._hooks)

    async def close(self) -> None:
        if self._link is not None:
            self._link.pool.close()

    def request(  # noqa: PLR0913 - one per part of a request; `target` only for `OPTIONS *`
        self,
        method: str,
        url: URL,  # encoded=True: its path and query go out byte for byte (SPEC §10 fidelity)
        headers: Any,
        body: bytes | AsyncIterable[bytes] | None,
        *,
        content_length: int | None = None,
        timeout: float | None = None,
        target: str | None = None,
    ) -> Exchange:
        """`async with client.request(…) as response`: sends the request and gives the response
        once its head arrived; leaving the block gives the connection back. `timeout` overrides
        the client's for this request (a route's `upstream_timeout`). The Host sent is the one
        in `headers` (a CIMultiDict; SPEC §10 `forward_host`), by
        default the URL's authority. `target` is sent in place of the URL's path and query: `*`
        for `OPTIONS *` (RFC 9112 §3.2.4), which no URL holds."""
        if self._link is None:
            raise RuntimeError("UpstreamClient.open() was not called")
        found = self._origins.get((url.scheme, url.raw_host, url.port))
        origin, authority = self._origin(url) if found is None else found
        if isinstance(body, bytes | bytearray) and (body or method not in _NO_BODY_METHODS):
            framing = f"Content-Length: {len(body)}\r\n"  # `framing_for`'s common case
        else:
            framing = framing_for(method, body, content_length)
        host = headers.get("Host") or authority
        if target is None:
            target = url.raw_path_qs
        head = request_head(method, target, host, headers, framing + self._closing_each)
        wait = self._timeout if timeout is None else timeout
        if body is None or isinstance(body, bytes | bytearray):
            return Exchange(self._link, origin, method, head, body, wait)
        return Exchange(self._link, origin, method, head, StreamedBody(body, content_length), wait)

    async def send(
        self,
        method: str,
        url: URL,
        headers: Any,
        body: bytes | AsyncIterable[bytes] | None,
        *,
        content_length: int | None = None,
        timeout: float | None = None,
    ) -> tuple[Exchange, UpstreamResponse]:
        """`request`, opened: the exchange, to `close` once done with its response, and the
        response with its head. For a caller that holds the exchange beyond one block (an
        attempt), in one call rather than two."""
        exchange = self.request(
            method, url, headers, body, content_length=content_length, timeout=timeout
        )
        return exchange, await exchange.open()

    def _origin(self, url: URL) -> tuple[Origin, str]:
        """(host, port, TLS) and the Host header for an upstream URL, the first time; `request`
        finds them in the cache afterwards."""
        if url.scheme not in _DEFAULT_PORTS or not url.raw_host:
            raise UpstreamFailure(Failure.CONNECT, f"unsupported upstream URL: {url}")
        port = url.port or _DEFAULT_PORTS[url.scheme]
        host = url.raw_host
        # RFC 9110 §7.2: the port is left out when it is the scheme's default.
        authority = f"[{host}]" if ":" in host else host
        if url.explicit_port and port != _DEFAULT_PORTS[url.scheme]:
            authority = f"{authority}:{port}"
        found = ((host, port, url.scheme == "https"), authority)
        self._origins[(url.scheme, url.raw_host, url.port)] = found
        return found

    @staticmethod
    async def read_body(response: UpstreamResponse, limit: int) -> tuple[bytes, bool]:
        """Up to `limit` bytes of the body; the flag says whether all of it fits."""
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = await response.read_chunk()
            if not chunk:
                return b"".join(chunks), True
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks), False

    @staticmethod
    async def iter_body(response: UpstreamResponse) -> AsyncIterator[bytes]:
        while chunk := await response.read_chunk():
            yield chunk


def request_head(method: str, target: str, host: str, headers: Any, framing: str) -> bytes:
    """The request line and headers (RFC 9112 §3, §5), ready for the wire."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    for name, value in headers.items():
        if name.lower() not in _FRAMING:
            lines.append(f"{name}: {value}\r\n")
    lines.append(framing)
    lines.append("\r\n")
    head = "".join(lines)
    # Values come from a parsed request, which can not hold CR or LF; a line more than the
    # headers would be a request smuggled into the head: refuse to send it.
    breaks = len(lines) + framing.count("\n")  # the request line and Host: two
    if head.count("\n") != breaks or head.count("\r") != breaks:
        raise UpstreamFailure(Failure.CONNECT, "refused to send a header with a line break")
    return head.encode("utf-8", "surrogateescape")


def framing_for(method: str, body: object, content_length: int | None) -> str:
    if isinstance(body, bytes | bytearray):
        if body or method not in _NO_BODY_METHODS:
            return f"Content-Length: {len(body)}\r\n"
        return ""
    if body is None:
        return "" if method in _NO_BODY_METHODS else "Content-Length: 0\r\n"
    if content_length is not None:
        return f"Content-Length: {content_length}\r\n"
    return "Transfer-Encoding: chunked\r\n"
