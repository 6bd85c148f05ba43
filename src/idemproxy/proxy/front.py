"""The client-facing connection: plain requests served without aiohttp's connection loop.

aiohttp's connection handler spends about a third of a pass-through's instructions on each
request (bench/findings.md): its parser's message objects, a payload stream, a future and a task
to wake its per-connection loop, then a second task for the handler. Most requests a proxy sees
are plain: a head of CRLF lines and at most a short body of declared length.
`FrontConnection` frames those itself, parses the head with httptools (llhttp, the parser
aiohttp's is built on), builds the same `web.Request` aiohttp would and runs the handler in one
task; a complete response goes out in one write (proxy/whole.py), any other through aiohttp's
own response path.

Anything else is handed, with every byte of it, to aiohttp's connection handler
(`listener.GuardedHandler`), which serves the connection from then on, so that its parser's
checks and limits apply as they always did (tests/hostile): a head that is not plain (another
HTTP version, a target not in origin form, Transfer-Encoding, Expect, Upgrade, a repeated
singleton header, bare LF line ends, more header lines than allowed, a head longer than a line
may be), one that llhttp refuses, and a body longer than 64 KiB. A body that follows its head
in later packets (as many clients send it) is fed to the request as it arrives, as aiohttp
does: the handler's body-read deadline applies to it (SPEC §9). The header-read deadline and
the keep-alive idle timeout are kept here on one timer (deadline.py), as in `GuardedHandler`; a
connection handed over keeps the header-read time it has left. If the handler answers before
the body is in, the rest of the body is read and dropped (as aiohttp's lingering does) before
the next request, or the connection closes after a 408.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Protocol

import httptools
from aiohttp import HttpVersion11, StreamReader, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_parser import RawRequestMessage
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.tcp_helpers import tcp_keepalive
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from idemproxy.proxy.any_path import RequestHandler
from idemproxy.proxy.deadline import Deadline
from idemproxy.proxy.problems import REQUEST_TIMEOUT_RESPONSE
from idemproxy.proxy.whole import mark_sent, serialise_whole

log = logging.getLogger(__name__)

# Bodies up to this size are served here when they arrived with their head; the proxy reads
# such bodies whole anyway (proxy/passthrough.py).
WHOLE_BODY = 64 * 1024
# Pipelined bytes buffered while a request is served, before reading pauses (a client may not
# flood the proxy's memory by pipelining).
_PIPELINE_BUFFER = 256 * 1024
_END_OF_HEAD = b"\r\n\r\n"
# RFC 9110 §9: the methods with no surprises in framing; others go to aiohttp (CONNECT).
_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"})
# Heads with these go to aiohttp: framing it handles (RFC 9112 §6.1), the interim response of
# RFC 9110 §10.1.1, and protocol switches (RFC 9110 §7.8; aiohttp refuses hixie-76's key).
_HAND_OFF = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"sec-websocket-key1"})
# Headers aiohttp refuses to see twice (its parser's SINGLETON_HEADERS): a repeat goes to it.
_SINGLETON = frozenset(
    {
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"host",
        b"max-forwards",
        b"server",
        b"transfer-encoding",
        b"user-agent",
    }
)
_CONTENT_LENGTH = b"content-length"
# llhttp's refusals, and its stop at a protocol switch (not an HttpParserError).
_PARSER_ERRORS = (httptools.HttpParserError, httptools.HttpParserUpgrade)
_HOST = b"host"


class Successor(Protocol):
    """What serves a connection handed over: aiohttp's handler (listener.GuardedHandler)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...

    def data_received(self, data: bytes) -> None: ...

    def owe_head_within(self, seconds: float) -> None: ...


class FrontLimits:
    """What a plain head may be, and the connection's deadlines (from ServerSettings)."""

    __slots__ = (
        "body_timeout",
        "head_bytes",
        "header_lines",
        "header_timeout",
        "keepalive_timeout",
    )

    def __init__(
        self,
        *,
        head_bytes: int,
        header_lines: int,
        header_timeout: float,
        keepalive_timeout: float,
        body_timeout: float,
    ) -> None:
        self.head_bytes = head_bytes  # no line of a head this long is over aiohttp's limits
        self.header_lines = header_lines
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.body_timeout = body_timeout


class _Head:
    """httptools' callbacks for one request: its head as it came, and what llhttp made of it
    (read when the head is complete: the parser forgets it once the message is)."""

    __slots__ = ("complete", "keep_alive", "lines", "method", "parser", "target", "version")

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.target = b""
        self.lines: list[tuple[bytes, bytes]] = []
        self.method = b""
        self.version = ""
        self.keep_alive = False
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # RFC 9110 §5.5: trailing whitespace is not part of the value; llhttp keeps it, and
        # aiohttp's parser strips it.
        self.lines.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        parser = self.parser
        self.method = parser.get_method()
        self.version = parser.get_http_version()
        self.keep_alive = parser.should_keep_alive()

    def on_message_complete(self) -> None:
        self.complete = True


class FrontConnection(BaseProtocol):
    """One client connection (see the module docstring). Registered with aiohttp's `Server`
    like its own handlers, so that the runner's shutdown closes it the same way."""

    _task_handler = None  # what `web.Server.connection_lost` looks for on its handlers

    def __init__(
        self,
        server: web.Server,
        app: web.Application,
        handler: RequestHandler,
        fallback: Callable[[], Successor],
        limits: FrontLimits,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(loop)
        self._server = server
        self._app = app
        self._handler = handler
        self._fallback = fallback
        self._limits = limits
        self._deadline = Deadline(loop, self._deadline_passed)
        self._buffer = b""
        self._busy: asyncio.Task[None] | None = None  # the request being served
        self._request: web.Request | None = None
        self._body_left = 0  # bytes of the current request's body still to come
        self._body: StreamReader | None = None  # where they go (None: dropped)
        self._lingering = False  # answered: dropping the rest of the body, then the next
        self._head_started = False  # bytes of a head arrived since the last response
        self._idle = False  # kept alive between requests: the deadline is the idle timeout
        self._closing = False  # shutting down: no request after the current one
        self._held = False  # reading paused while pipelined bytes wait
        self.peername: Any = None
        self.sockname: Any = None
        self.ssl_context: Any = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        stream = self.transport
        assert stream is not None
        tcp_keepalive(stream)  # as aiohttp's handler: dead peers are noticed
        self.peername = stream.get_extra_info("peername")
        self.sockname = stream.get_extra_info("sockname")
        self.ssl_context = stream.get_extra_info("sslcontext")
        self._server.connection_made(self, stream)  # type: ignore[arg-type]
        self._deadline.start(self._limits.header_timeout)  # the first head is owed

    def data_received(self, data: bytes) -> None:
        if self._body_left:
            data = self._take_body(data)
            if not data:
                return
        self._buffer = self._buffer + data if self._buffer else data
        if self._busy is not None:  # pipelined: parsed once the current response is out
            if len(self._buffer) > _PIPELINE_BUFFER and not self._held:
                self._held = True
                self._pause_transport_reading()
            return
        if self._idle:  # the first byte of the next head: its deadline starts (SPEC §9)
            self._idle = False
            self._deadline.start(self._limits.header_timeout)
        self._head_started = True  # a new connection's deadline runs from its start
        self._next_request()

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._deadline.close()
        self._server.connection_lost(self, exc)  # type: ignore[arg-type]
        # A request in flight runs on (SPEC §2: a client hanging up cancels nothing); a read
        # of its body fails as with aiohttp's handler.
        if self._request is not None:
            self._request._cancel(exc or ConnectionResetError("Connection lost"))

    def pause_reading(self) -> None:  # flow control of a request's body stream: it is whole
        self._pause_transport_reading()

    def resume_reading(self, resume_parser: bool = True) -> None:
        self._resume_transport_reading()

    # web.Server's shutdown (as for aiohttp's RequestHandler)

    def close(self) -> None:
        """No request after the current one; an idle connection closes now."""
        self._closing = True
        if self._busy is None and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """As aiohttp's: the request in flight gets `timeout`, then it is cancelled."""
        self._closing = True
        task = self._busy
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
        if self.transport is not None:
            self.transport.close()

    # Requests

    def _next_request(self) -> None:
        buffer = self._buffer
        end = buffer.find(_END_OF_HEAD)
        if end < 0:
            if len(buffer) > self._limits.head_bytes or _bare_line_feed(buffer):
                self._hand_off()
            return  # the rest of the head is on its way
        head_size = end + len(_END_OF_HEAD)
        parsed = self._parse(buffer, head_size)
        if parsed is None:
            self._hand_off()
            return
        message, body_size = parsed
        self._deadline.stop()  # SPEC §9: the head arrived; the body's deadline is the handler's
        payload = EMPTY_PAYLOAD
        if body_size:
            payload = StreamReader(self, WHOLE_BODY, loop=self._loop)
            self._body, self._body_left = payload, body_size
            buffer = self._take_body(buffer[head_size:])
        else:
            buffer = buffer[head_size:]
        self._buffer = buffer
        self._busy = self._loop.create_task(self._serve(message, payload))

    def _take_body(self, data: bytes) -> bytes:
        """Feed the current body what of `data` belongs to it; the rest is the next head's."""
        left = self._body_left
        part, rest = (data, b"") if len(data) <= left else (data[:left], data[left:])
        self._body_left = left = left - len(part)
        body = self._body
        if body is not None:
            body.feed_data(part)
            if not left:
                body.feed_eof()
        if not left:
            self._body = None
            if self._lingering:  # the rest of an answered request's body: now the next one
                self._lingering = False
                self._buffer = rest
                self._next_after_response()
                return b""
        return rest

    def _parse(self, buffer: bytes, head_size: int) -> tuple[RawRequestMessage, int] | None:
        """The request as aiohttp's parser would build it, and its body's size; None for a
        request that is not plain."""
        if head_size > self._limits.head_bytes or _bare_line_feed(buffer[:head_size]):
            return None
        head = _Head()
        parser = head.parser
        try:
            parser.feed_data(buffer[:head_size])
        except _PARSER_ERRORS:
            return None  # aiohttp answers it as it always did
        finally:
            head.parser = None  # type: ignore[assignment]  # no cycle to outlive the head
        lines = head.lines
        if (
            len(lines) > self._limits.header_lines
            or head.version != "1.1"
            or head.method not in _METHODS
            or not head.target.startswith(b"/")
        ):
            return None
        body_size = _body_size(lines)
        if body_size is None or (not body_size and not head.complete):
            return None
        return _message(head), body_size  # the body is framed by its length alone

    async def _serve(self, message: RawRequestMessage, payload: StreamReader) -> None:
        writer = StreamWriter(self, self._loop)
        task = self._busy
        assert task is not None
        request = self._app._make_request(message, payload, self, writer, task)  # type: ignore[arg-type]
        self._request = request
        keep_alive, status = False, 0
        try:
            response = await self._answer(request)
            if response is not None:
                keep_alive, status = await self._send(request, response), response.status
        except Exception:  # a response that could not be sent: the connection is unusable
            log.exception("error sending a response")
        finally:
            self._busy = self._request = None
        self._after_response(keep_alive, status)

    async def _answer(self, request: web.Request) -> web.StreamResponse | None:
        """The handler's response, or the one aiohttp's `_handle_request` would make; None
        where the handler failed after its response had started (nothing more can be sent)."""
        try:
            return await self._handler(request)
        except web.HTTPException as exc:
            return exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if request.writer.output_size > 0:
                log.warning("response cut off: %r", exc)
                return None
            if isinstance(exc, TimeoutError):
                return _plain(504)
            log.exception("error handling request")
            return _plain(500)

    async def _send(self, request: web.Request, response: web.StreamResponse) -> bool:
        """Send the response; whether the connection stays open for another request."""
        whole = serialise_whole(request, response)
        if whole is None:
            try:
                await response.prepare(request)
                await response.write_eof()
            except ConnectionError:
                return False
            return bool(response.keep_alive)
        mark_sent(response, whole.keep_alive)
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        transport.write(whole.data)
        if self._paused:
            try:
                await self._drain_helper()
            except ConnectionError:
                return False
        return whole.keep_alive

    def _after_response(self, keep_alive: bool, status: int) -> None:
        transport = self.transport
        if transport is None:
            return
        if not keep_alive or self._closing:
            transport.close()
            return
        if self._body_left:  # answered before the whole body came
            if status == 408:  # too slow to send it: it would not finish (listener.py)
                transport.close()
                return
            self._body, self._lingering, self._head_started = None, True, False
            self._deadline.start(self._limits.body_timeout)  # then closed, silently
            return
        self._next_after_response()

    def _next_after_response(self) -> None:
        if self._held:
            self._held = False
            self._resume_transport_reading()
        if self._buffer:  # the next head has (partly) arrived: its deadline starts now
            self._head_started = True
            self._deadline.start(self._limits.header_timeout)
            self._next_request()
        else:
            self._head_started = False
            self._idle = True
            self._deadline.start(self._limits.keepalive_timeout)

    def _deadline_passed(self) -> None:
        transport = self.transport
        if self._busy is not None or transport is None or transport.is_closing():
            return
        if self._head_started:  # RFC 9110 §15.5.9; an idle connection just closes
            transport.write(REQUEST_TIMEOUT_RESPONSE)
        transport.close()

    def _hand_off(self) -> None:
        """aiohttp's handler serves the connection from here, from the bytes not yet served."""
        transport = self.transport
        assert transport is not None
        data, self._buffer = self._buffer, b""
        left = self._deadline.left()  # a head has started: bytes arrived
        self._deadline.close()
        self._server.connection_lost(self, None)  # type: ignore[arg-type]
        self.transport = None
        handler = self._fallback()
        transport.set_protocol(handler)  # type: ignore[arg-type]
        handler.connection_made(transport)
        if left is not None:
            handler.owe_head_within(left)
        if data:
            handler.data_received(data)


def _bare_line_feed(head: bytes) -> bool:
    """RFC 9112 §2.2 lets a recipient take a bare LF as a line end; aiohttp decides that."""
    return head.count(b"\n") != head.count(b"\r\n")


def _body_size(lines: list[tuple[bytes, bytes]]) -> int | None:
    """Content-Length (RFC 9112 §6.3: none means no body), or None for a head to hand off."""
    size = 0
    seen: set[bytes] = set()
    for name, value in lines:
        lowered = name.lower()
        if lowered in _HAND_OFF:
            return None
        if lowered in _SINGLETON:
            if lowered in seen:
                return None
            seen.add(lowered)
            if lowered == _CONTENT_LENGTH:
                if not value.isdigit():
                    return None
                size = int(value)
    if _HOST not in seen:  # RFC 9112 §3.2: 400 for HTTP/1.1 without Host, aiohttp's to give
        return None
    return size if size <= WHOLE_BODY else None


def _message(head: _Head) -> RawRequestMessage:
    """What aiohttp's parser builds for this head (names and values decoded as it decodes
    them; the URL built as it builds one for an origin-form target)."""
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in head.lines:
        headers.add(
            name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")
        )
    target = head.target.decode("utf-8", "surrogateescape")
    path, _, fragment = target.partition("#")
    path, _, query = path.partition("?")
    url = URL.build(path=path, query_string=query, fragment=fragment, encoded=True)
    return RawRequestMessage(
        head.method.decode("ascii"),
        target,
        HttpVersion11,
        CIMultiDictProxy(headers),
        tuple(head.lines),
        not head.keep_alive,
        None,
        False,
        False,
        url,
    )


def _plain(status: int) -> web.Response:
    """aiohttp's own page for a handler's failure, and the connection closed after it."""
    response = web.Response(status=status, text=f"{status} {HTTPStatus(status).phrase}")
    response.force_close()
    return response
