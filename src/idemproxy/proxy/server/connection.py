"""One client connection, from its bytes to its answers: the slow-client deadline aiohttp
lacks (SPEC §9), quiet 400s (§8), the listener of `idemproxy serve`, a governed request's
bounded body, whole answers in one write, and one answer per request. In that order below.

aiohttp reads a request head without a deadline of its own. Before 3.14 a connection that
trickles header bytes (slowloris) is never cut off; since then only by `keepalive_timeout`, which
behind a load balancer must outlast the balancer's idle timeout (60 s on AWS ALB). Each
connection here is served by `GuardedHandler` instead: a new connection must deliver its first
request head within `server.header_read_timeout`, and on a kept-alive connection the next head
must arrive in full within that time of its first byte. Idle time between requests stays
`keepalive_timeout`'s business. A head that is too slow gets 408 and the connection is closed;
nothing of it reached the handler, so no job exists and nothing went upstream.

From the moment aiohttp hands a request to the listener's request handler (`request_started`)
only the body deadline (`server.body_read_timeout`) and the upstream timeout apply, until that
handler has written the response (`respond`). Only aiohttp's public API is used: the protocol
methods of asyncio (`connection_made`, `data_received`, `connection_lost`) and `handle_error`
are extended, never aiohttp's private fields (tests/unit/test_public_aiohttp.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import logging
import mmap
import os
import re
import tempfile
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from http.cookies import SimpleCookie
from typing import Any, BinaryIO, Protocol, cast

from aiohttp import HttpVersion, HttpVersion10, HttpVersion11, StreamReader, hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, InvalidHeader
from aiohttp.http_parser import RawRequestMessage
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict

from idemproxy.config.settings import LimitsSettings, ServerSettings, parse_listen
from idemproxy.constants import ERROR_HEADER, PROBLEM_CONTENT_TYPE
from idemproxy.errors import (
    BodyInvalid,
    BodyTooLarge,
    ClientDisconnected,
    HeaderInvalid,
    ProblemError,
    RequestTimeout,
)
from idemproxy.http.as_sent import TARGET_AS_SENT
from idemproxy.http.deadline import Deadline
from idemproxy.http.headers import asks_the_server, split_absolute_form
from idemproxy.http.problems import problem_response
from idemproxy.identity.intent import Reencoding, reencoding
from idemproxy.identity.reencoded import Body
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.server.any_path import proxied
from idemproxy.proxy.server.chunks import GAVE_UP, ChunkWalk, begins_head
from idemproxy.proxy.server.gate import ConnectionGate, listening_sockets
from idemproxy.redact import redact_path

# Complete responses in one write, without aiohttp's machinery for streamed ones.
#
# Most of the proxy's answers are whole: replays, problems, and the pass-through and governed
# answers it read in full. aiohttp sends each of them through the path built for streaming
# (`prepare`, the header preparation, the prepare signal, a payload writer, `write_eof`), six
# coroutines deep: about 45,000 instructions a response, a fifth of aiohttp's own cost per request
# (bench/findings.md). For a plain `web.Response` whose body is bytes, this module builds the same
# bytes directly: the headers aiohttp would add, in the order it adds them, serialised as every
# head of the listener is (header values byte for byte; CR or LF in a
# status line or header refused). Anything that needs more of that machinery (a streamed body,
# compression, cookies, chunking, HEAD, a status without a body, a declared Content-Length, a
# Connection header of the handler's) goes aiohttp's usual way.


# RFC 9110 §5.5, RFC 9112 §4: a CR or LF of a status line or field would split the response in
# two; aiohttp refuses those in any head, and the other control characters in a head with
# obs-text (its Python serializer's check, which ASCII heads never reached).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def serialise_head(status_line: str, headers: CIMultiDict[str]) -> bytes:
    """The status line and header fields, each value as the bytes it was decoded from."""
    lines = [status_line, *[f"{name}: {value}" for name, value in headers.items()], "\r\n"]
    text = "\r\n".join(lines)
    # Counted rather than searched line by line: the only breaks are the ones joined in.
    breaks = len(lines)
    if (
        text.count("\r") != breaks
        or text.count("\n") != breaks
        or (not text.isascii() and _CONTROL.search(text) is not None)
    ):
        # aiohttp's own words, so that the listener fails as aiohttp does.
        raise ValueError(
            "Forbidden control character detected in headers. Potential header injection attack."
        )
    return text.encode("utf-8", "surrogateescape")


def name_server(
    headers: CIMultiDict[str], upstream_absent: tuple[str, ...] | None, server_token: str
) -> None:
    """SPEC §10: the proxy's own answers name the server `server_token`, or nothing when it is
    empty, instead of aiohttp's `Python/x aiohttp/y`. An upstream's answer (`upstream_absent`
    is then the fields it did not send) keeps what it sent: the fields aiohttp invented for it
    as it prepared the head are taken out again."""
    if upstream_absent is not None:
        for name in upstream_absent:
            headers.popall(name, None)
    elif server_token:
        headers[hdrs.SERVER] = server_token
    else:
        headers.popall(hdrs.SERVER, None)


class ServingConnection(Protocol):
    """What a head needs of the listener's connection."""

    @property
    def closing(self) -> bool:
        """A shutdown began: the connection closes after this response (SPEC §8)."""

    @property
    def server_token(self) -> str:
        """The Server field of the proxy's own answers (SPEC §10)."""


class HeadWriter(StreamWriter):
    """aiohttp's payload writer, with the head serialised by `serialise_head` and written at
    once (aiohttp 3.12 and later hold it back to send it with the first body bytes; a whole
    response, the common case, is one write anyway: `serialise_whole`).

    One per request. On `connection`'s requests a head also gets what the app's prepare hooks
    would give it: its Server field (`name_server`), `Connection: close` once a shutdown began,
    and it is noted (`started_headers`: the headers of the response whose head went out, so
    that no other response follows it)."""

    # Class defaults, not an __init__ of its own: one writer is made per request.
    connection: ServingConnection | None = None
    # Set by an upstream's response as it prepares: the fields aiohttp
    # is about to invent for it. None for the proxy's own answers.
    upstream_absent: tuple[str, ...] | None = None
    started_line = ""
    started_headers: CIMultiDict[str] | None = None

    async def write_headers(self, status_line: str, headers: CIMultiDict[str]) -> None:
        connection = self.connection
        if connection is not None:
            name_server(headers, self.upstream_absent, connection.server_token)
            if connection.closing:
                # SPEC §8, RFC 9112 §9.6: the response after which a shutdown closes the
                # connection says so (the connection's `respond` makes it close).
                headers[hdrs.CONNECTION] = "close"
            self.started_line, self.started_headers = status_line, headers
        head = serialise_head(status_line, headers)
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(head)
        self.buffer_size += len(head)
        self.output_size += len(head)


# A larger body is not copied behind its head: it goes out after it, in pieces (memoryviews of
# the one bytes object, so a replay of a large stored body costs no copy of it).
ONE_WRITE_BODY = 64 * 1024
_PIECE = 256 * 1024
# RFC 9110 §6.4.1, §15.3.5, §15.4.5: no content with these (aiohttp's `must_be_empty_body`).
_WITHOUT_CONTENT = frozenset({204, 304})
_VERSIONS = (HttpVersion11, HttpVersion10)


@dataclass(frozen=True, slots=True)
class WholeResponse:
    """The response's bytes (the head and a small body, then a large body on its own), and
    whether the connection stays open after it."""

    data: bytes
    keep_alive: bool
    body: bytes = b""

    def pieces(self) -> list[memoryview]:
        view = memoryview(self.body)
        return [view[start : start + _PIECE] for start in range(0, len(view), _PIECE)]


def serialise_whole(
    request: web.BaseRequest, response: web.StreamResponse, *, server_token: str
) -> WholeResponse | None:
    """The bytes aiohttp would send for `response`, or None where its usual path must run.

    Adds, as aiohttp does when it prepares a response:
    Content-Length, Content-Type `application/octet-stream` for a non-empty body without one
    (RFC 9110 §8.3) unless the fields are an upstream's (`AsSentResponse`), Date, and
    `Connection: keep-alive` (HTTP/1.0) or `close` (HTTP/1.1) where the connection's persistence
    differs from the version's default (RFC 9112 §9.3). Server is `server_token` on the proxy's
    own answers (none when empty), and on an upstream's only what the upstream sent.
    """
    if not isinstance(response, web.Response) or type(response) not in _WHOLE or response.prepared:
        return None
    body = response.body
    if body is None:
        body = b""  # aiohttp sends the head alone, with Content-Length: 0
    if (
        type(body) is not bytes
        or response.chunked
        or response.compression
        or _has_cookies(response)
        or request.method == hdrs.METH_HEAD
        or response.status < 200
        or response.status in _WITHOUT_CONTENT
    ):
        return None
    version = request.version
    headers = response.headers
    if version not in _VERSIONS or _framed(headers):
        return None
    keep_alive = response.keep_alive
    if keep_alive is None:
        keep_alive = request.keep_alive
    headers[hdrs.CONTENT_LENGTH] = str(len(body))
    own = not isinstance(response, AsSentResponse)
    if body and own:
        headers.setdefault(hdrs.CONTENT_TYPE, "application/octet-stream")
    if hdrs.DATE not in headers:
        headers[hdrs.DATE] = rfc822_formatted_time()
    if server_token and own:
        headers.setdefault(hdrs.SERVER, server_token)
    _persistence(headers, version, keep_alive)
    status_line = f"HTTP/{version.major}.{version.minor} {response.status} {response.reason}"
    head = serialise_head(status_line, headers)
    if len(body) > ONE_WRITE_BODY:
        return WholeResponse(head, keep_alive, body)
    return WholeResponse(head + body, keep_alive)


def _has_cookies(response: web.Response) -> bool:
    """Whether aiohttp would add Set-Cookie fields of its own cookie jar. An upstream's
    response (`AsSentResponse`) carries its Set-Cookie fields in its headers and has a jar only
    once something asked for it; reading `cookies` of any other response creates an empty
    one, about 1,500 instructions a response."""
    if isinstance(response, AsSentResponse):
        return response.jar_used
    return bool(response.cookies)


def _persistence(headers: CIMultiDict[str], version: HttpVersion, keep_alive: bool) -> None:
    """RFC 9112 §9.3: say so where the connection's persistence is not the version's default."""
    if keep_alive:
        if version == HttpVersion10:
            headers[hdrs.CONNECTION] = "keep-alive"
    elif version == HttpVersion11:
        headers[hdrs.CONNECTION] = "close"


def _framed(headers: CIMultiDict[str]) -> bool:
    """The handler framed the message itself: leave it to aiohttp."""
    return (
        hdrs.CONTENT_LENGTH in headers
        or hdrs.TRANSFER_ENCODING in headers
        or hdrs.CONNECTION in headers
    )


def absent_fields(headers: CIMultiDict[str]) -> tuple[str, ...]:
    """The fields that aiohttp invents when it prepares a response and that an upstream's
    answer must not get (`name_server` removes them again): Content-Type, for a body that
    has none (RFC 9110 §8.3: the recipient may then inspect the body; `application/octet-stream`
    would tell it not to), and Server (`Python/3.11 aiohttp/3.14.5` would advertise the proxy's
    versions as the upstream's)."""
    return tuple(name for name in _INVENTED if name not in headers)


_INVENTED = (hdrs.CONTENT_TYPE, hdrs.SERVER)


def own_server_header(
    server_token: str,
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """`on_response_prepare`: the Server field (`name_server`) of a response that takes
    aiohttp's path (not `serialise_whole`'s) through the app's router (aiohttp runs this signal
    after it prepared the headers, before it serialises them); the listener's `HeadWriter`
    does the same without it."""

    async def named(_request: web.Request, response: web.StreamResponse) -> None:
        absent = None
        if isinstance(response, AsSentResponse | AsSentStreamResponse):
            absent = response.absent
        name_server(response.headers, absent, server_token)

    return named


def as_sent(request: web.BaseRequest, headers: CIMultiDict[str]) -> tuple[str, ...]:
    """The fields aiohttp is about to invent for an upstream's response (`absent_fields`), told
    to the listener's writer too, which takes them out again."""
    absent = absent_fields(headers)
    writer = request.writer
    if type(writer) is HeadWriter:
        writer.upstream_absent = absent
    return absent


class AsSentStreamResponse(web.StreamResponse):
    """A streamed response whose header fields are an upstream's, or the store's copy of them:
    aiohttp adds the framing and Date, never a Content-Type nor a Server (SPEC §10)."""

    absent: tuple[str, ...] = ()

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if not self.prepared:
            self.absent = as_sent(request, self.headers)
            if request.version < HttpVersion11 and _ends_at_close(self, request):
                # RFC 9112 §6.3: no chunked coding in HTTP/1.0, so a body of unknown length
                # ends where the connection does, keep-alive or not (aiohttp still keeps it).
                self.force_close()
        return await super().prepare(request)


def _ends_at_close(response: web.StreamResponse, request: web.BaseRequest) -> bool:
    """Whether the response has a body and no length: it ends where the connection closes."""
    no_body = request.method == hdrs.METH_HEAD or response.status in (204, 304)
    return not no_body and response.status >= 200 and response.content_length is None


class AsSentResponse(web.Response):
    """A whole response whose header fields are an upstream's, or the store's copy of them:
    aiohttp (or `serialise_whole`) adds the framing and Date, never a Content-Type nor a
    Server."""

    absent: tuple[str, ...] = ()
    jar_used = False  # `cookies` or `set_cookie` (which `del_cookie` calls) was used

    @property
    def cookies(self) -> SimpleCookie:
        self.jar_used = True
        return super().cookies

    def set_cookie(self, name: str, value: str, **options: Any) -> None:
        self.jar_used = True
        super().set_cookie(name, value, **options)

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if not self.prepared:
            self.absent = as_sent(request, self.headers)
        return await super().prepare(request)


class NotifiedResponse(AsSentResponse):
    """A complete response whose `done` runs once when it has been written, by either path, or
    when it is dropped unsent: what it holds (a budget's bytes, a shared body) is given back.
    With `hold`, `done` runs after that many seconds at the latest: a client that does not read
    must not keep what it holds for ever (SPEC §9; the bytes themselves stay until written)."""

    def __init__(
        self, *, done: Callable[[], None], hold: float | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.written = _once(done)
        if hold is not None:
            once, timer = self.written, asyncio.get_running_loop().call_later(hold, self.written)

            def written() -> None:
                timer.cancel()
                once()

            self.written = written
        weakref.finalize(self, self.written)

    async def write_eof(self, data: bytes = b"") -> None:
        try:
            await super().write_eof(data)
        finally:
            self.written()


# The classes `serialise_whole` writes (a subclass of its own could change what goes out).
_WHOLE = frozenset({web.Response, AsSentResponse, NotifiedResponse})


def _once(done: Callable[[], None]) -> Callable[[], None]:
    ran = False

    def once() -> None:
        nonlocal ran
        if not ran:
            ran = True
            done()

    return once


log = logging.getLogger(__name__)


class SentResponse(web.StreamResponse):
    """What aiohttp's connection loop gets back for a response the listener wrote itself: its
    own `prepare` and `write_eof` have nothing left to do, and `keep_alive` says whether the
    connection serves another request. `status` and `headers` are those of the response
    written, where something reads them."""

    # A field, not StreamResponse's property: aiohttp reads it after every request.
    keep_alive: bool = True

    def __init__(
        self, *, persistent: bool, status: int = 200, headers: CIMultiDict[str] | None = None
    ) -> None:
        super().__init__(status=status, headers=headers)
        self.keep_alive = persistent

    async def prepare(self, request: web.BaseRequest) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


# Shared: aiohttp only reads `keep_alive` (and, with an access log, status and size) of them.
_KEPT_ALIVE = SentResponse(persistent=True)
_CLOSED = SentResponse(persistent=False)


class GuardedHandler(web.RequestHandler):
    """aiohttp's connection handler plus a header-read deadline and 4xx pages that echo nothing."""

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        header_timeout: float,
        server_token: str,
        on_closed: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self.on_closed = on_closed  # the connection gate's count (proxy/server/gate.py)
        self.header_timeout = header_timeout
        self.server_token = server_token  # the Server field of the proxy's own answers
        self.head_deadline = Deadline(loop, self._head_timed_out)  # one timer (deadline.py)
        self.serving = False  # the head of the current request was read; its handler runs
        self.head_started = False  # bytes of the next head arrived since the last response
        self.body: StreamReader | None = None  # the body of the request being served
        self.queued = False  # bytes after that body arrived: a pipelined request waits
        self.unread: StreamReader | None = None  # a body aiohttp drains after the response
        # The next response closes the connection: a shutdown began, or bytes after an upgrade
        # request were lost (`request_started`).
        self.closing = False
        # The request being answered is an Upgrade the proxy does not take, or a CONNECT: what
        # follows it is never read.
        self.switching = False
        # The read that began the current head on an idle connection, while no other read
        # came after it: the only bytes a refused request can be in for its 400 to be paired
        # with it (`handle_error`); None once another read came (or none began a head).
        self.refusable: bytes | None = None
        # The last bytes the client sent, across reads: a chunked body's closing blank line
        # may be cut anywhere (`…0\r\n`, `\r`, `\n`), and empty lines may follow it.
        self.tail = b""
        # A read that began with a request's head, and where in it the next request begins:
        # the requests it brought are told apart there, for the head deadline (`request_started`).
        self.burst: bytes | None = None
        self.burst_at = 0
        self.burst_reads = 0  # the reads joined in `burst` (`data_received`)
        self.framed = True  # the request being served has no body or a Content-Length
        # The chunked body of the request being served, followed read by read to its end, where
        # a next head may begin in the same read (`request_started`, `_pipelined`, `_drained`).
        self.chunks: ChunkWalk | None = None
        # Bytes of a next head are known to have arrived while a request was served: its
        # deadline runs from that request's response (`queued` also errs on the side of
        # waiting, for a shutdown's test of idleness).
        self.next_head = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # A new connection owes its first head within the deadline.
        self.head_deadline.start(self.header_timeout)

    def data_received(self, data: bytes) -> None:
        body = self.body
        if not data:  # aiohttp parses requests it held back: no read of the client's
            self.refusable = None
            super().data_received(data)
            return
        self.tail = data[-_TAIL:] if len(data) >= _TAIL else (self.tail + data)[-_TAIL:]
        if self.unread is not None and self._draining():  # nearly always None: no call
            self.refusable = None
            self._drained(data)
        elif self.serving and body is not None:
            self.refusable = None
            self._pipelined(body, data)
        elif self.head_started or data[0] not in _EMPTY_LINE or begins_head(data, 0):
            # A read that begins a head starts a burst; one that goes on with a head joins it
            # (up to _BURST_KEPT), so that where the request's body ends can still be followed
            # from its head (`request_started`).
            if self.head_started:
                self.refusable = None
                burst = self.burst
                self.burst_reads += 1  # each join copies the burst: a trickled head stops it
                if (
                    burst is not None
                    and self.burst_reads <= _BURST_READS
                    and len(burst) - self.burst_at + len(data) <= _BURST_KEPT
                ):
                    self.burst, self.burst_at = burst[self.burst_at :] + data, 0
                else:
                    self.burst, self.burst_at = None, 0
            else:
                self.burst, self.burst_at, self.refusable = data, 0, data
                self.burst_reads = 1
            self.head_started = True
            deadline = self.head_deadline
            if deadline.due is None:  # the first byte of the next head
                due = deadline.time() + self.header_timeout
                if deadline.armed <= due:  # its timer checks by then: a field (http/deadline.py)
                    deadline.due = due
                else:
                    deadline.start(self.header_timeout)
            super().data_received(data)
        else:
            super().data_received(data)  # empty lines before a head: ignored (RFC 9112 §2.2)

    def _pipelined(self, body: StreamReader, data: bytes) -> None:
        """Bytes while a request is served: its body's, or (some of them) a next request's,
        which aiohttp parses and queues now. The idleness test of a shutdown must know."""
        done, before = body.is_eof(), body.total_bytes
        super().data_received(data)
        walk = self.chunks
        if walk is not None and not done:
            end = walk.feed(data)
            if end is None:
                return  # the body goes on
            self.chunks = None
            if end != GAVE_UP:
                if begins_head(data, end):
                    self.burst, self.burst_at = data, end
                    self.queued = self.next_head = True
                return
            # Not followed to its end: as a body whose chunks were never followed, below.
        # With Content-Length the body takes exactly its bytes; a chunked body's framing makes
        # the rest look like more than it is, and the test errs on the side of waiting.
        if done or (body.is_eof() and len(data) > body.total_bytes - before):
            self.queued = True
            if done and self.burst is not None:
                # Requests of an earlier read still wait in aiohttp's queue: this read follows
                # them, and is followed after them.
                self.burst, self.burst_at = self.burst[self.burst_at :] + data, 0
            elif done or self.framed:
                # The next request begins where the body ended.
                at = 0 if done else body.total_bytes - before
                if not begins_head(data, at):
                    self.queued, self.burst = False, None
                    return
                self.burst, self.burst_at = data, at
            else:
                # A chunked body's framing hides where it ended. Its last read ends with the
                # terminator's blank line unless bytes of a next request follow it; a whole
                # next request may end the same way, so `queued` stays: a shutdown waits for
                # it (until its deadline) rather than close under a request it cannot see.
                self.burst = None
                self.next_head = _head_begun_after_chunks(self.tail)
                return
            self.next_head = True

    def _drained(self, data: bytes) -> None:
        """Bytes of a body that was answered unread (aiohttp drains it): any after its end begin
        the next head, which owes the deadline from its first byte (SPEC §9)."""
        unread, walk = self.unread, self.chunks
        before = unread.total_bytes if unread is not None else 0
        super().data_received(data)
        end = walk.feed(data) if walk is not None else GAVE_UP  # every read, to keep its place
        if end is not None:
            self.chunks = None
        if unread is None or not unread.is_eof():
            return
        self.chunks = None  # the body is whole: nothing of it left to follow
        at: int | None
        if self.framed:
            at = unread.total_bytes - before
            begun = begins_head(data, at)
        elif end is None or end == GAVE_UP:
            # Not followed to its end: the terminator's blank line ends its last read
            # unless bytes of a next request follow it.
            at, begun = None, _head_begun_after_chunks(self.tail)
        else:
            at, begun = end, begins_head(data, end)
        if begun:
            self.head_started = True
            self.burst, self.burst_at = (data, at) if at is not None else (None, 0)
            if self.head_deadline.due is None:
                self.head_deadline.start(self.header_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.head_deadline.close()
        if self.on_closed is not None:
            self.on_closed()
        super().connection_lost(exc)

    def close_when_idle(self) -> None:
        """A shutdown began (proxy/drain.py): close now if idle, else after the next response.

        Not aiohttp's `close()`, busy or idle: on a busy connection it drops every byte that
        arrives from then on, the rest of a request body too, and the request would hang on
        it; on an idle one it leaves the socket open (the wait for a next request ends
        without closing it) and a request sent on it would get no answer (SPEC §8)."""
        self.closing = True
        if not (self.begun() or self._draining()):
            self.force_close()

    def begun(self) -> bool:
        """Whether a request is being read or served, or bytes of a next one wait: a shutdown
        owes it an answer (SPEC §8), so its drain waits for it (proxy/drain.py)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        return self.serving or self.head_started or self.queued

    def request_started(self, body: StreamReader, head: RawRequestMessage) -> None:
        """aiohttp read a request's head and hands it to the handler: no deadline until the
        response. If the read that brought the head also brought bytes of a next request, a
        head begun there owes the deadline once this request is answered, as one begun later
        does (`_pipelined`), or a client stalls it until keepalive_timeout (SPEC §9). The
        requests of a read are followed while each one's end can be told: its head, then the
        body its Content-Length frames (none without one) or its chunks."""
        self.serving, self.body, self.framed = True, body, not head.chunked
        self.queued = self.next_head = False
        self.chunks = None
        self.head_deadline.due = None
        if head.upgrade or head.method == hdrs.METH_CONNECT:
            self.burst = None
            if not _switches_to_websocket(head):
                # What follows an upgrade aiohttp does not take up (or a CONNECT) may be lost in
                # its parser, never answered: close after this answer, so the client sends it
                # again on a new connection (RFC 9112 §9.3.2) instead of waiting for its answer.
                self.closing = self.switching = True
            return
        burst = self.burst  # written out here, not a call: once per request
        if burst is None:
            return
        at = self.burst_at
        if burst[at : at + 1] in _EMPTY_LINE_BYTES:  # rare: no call for every request
            at = _past_empty_lines(burst, at)
        end = burst.find(b"\r\n\r\n", at)
        if end == -1:
            self.burst = None
            return
        if head.chunked:
            # Rare: its chunks are walked to where the next request begins, in later reads too.
            walk = ChunkWalk()
            stop = walk.feed(burst, end + 4)
            if stop is None:
                self.chunks = walk
            elif stop == GAVE_UP:
                stop = None
                if body.is_eof():
                    # The whole body came with its head, and where it ended is not known:
                    # a next request may follow it (as `_pipelined` takes such a read).
                    self.queued = True
                    self.next_head = _head_begun_after_chunks(self.tail)
        else:
            length = head.headers.get(hdrs.CONTENT_LENGTH, "0")
            stop = end + 4 + int(length) if length.isdigit() else None
        if stop is not None and stop < len(burst) and begins_head(burst, stop):
            self.burst_at = stop
            self.queued = self.next_head = True
        else:
            self.burst = None

    async def respond(
        self, request: web.BaseRequest, response: web.StreamResponse
    ) -> web.StreamResponse:
        """Write `response` (every answer of the listener's handler ends here), in one write
        when it is whole; what aiohttp's loop then gets back."""
        if self.closing:
            # A shutdown closes this connection after the response (proxy/drain.py): say so,
            # so that the client sends its next request elsewhere (RFC 9112 §9.6).
            response.force_close()
        try:
            whole = serialise_whole(request, response, server_token=self.server_token)
            if whole is None:
                await response.prepare(request)
                await response.write_eof()
                return response
            return await self._write_whole(request, response, whole)
        except ConnectionError:
            self.force_close()  # the client is gone: aiohttp stops serving the connection
            return _CLOSED
        finally:
            self.served(request, response.status)

    async def _write_whole(
        self, request: web.BaseRequest, response: web.StreamResponse, whole: WholeResponse
    ) -> web.StreamResponse:
        """What aiohttp's `prepare` and `write_eof` do for a complete response, in one write."""
        transport = self.transport
        if transport is None or transport.is_closing():
            _written(response)
            raise ConnectionResetError("the client is gone")
        transport.write(whole.data)
        writer = request.writer
        writer.output_size += len(whole.data)
        if whole.body:
            await self._write_large(request, response, whole)
        elif transport.get_write_buffer_size():
            # Writing pauses only above the high-water mark: with nothing left in the buffer
            # (the socket took it all, nearly always) there is nothing to wait for.
            await writer.drain()
        return _KEPT_ALIVE if whole.keep_alive else _CLOSED

    async def _write_large(
        self, request: web.BaseRequest, response: web.StreamResponse, whole: WholeResponse
    ) -> None:
        """A large body after its head, in pieces: the transport keeps at most about its
        high-water mark beyond what the client took, rather than a copy of the whole body."""
        transport, writer = self.transport, request.writer
        writer.output_size += len(whole.body)
        try:
            for piece in whole.pieces():
                await writer.drain()
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("the client is gone")
                transport.write(piece)
            await writer.drain()
        finally:
            _written(response)

    def served(self, request: web.BaseRequest, status: int) -> None:
        """The response is out: the next byte starts a new head (unless it is unread body)."""
        self.serving = False
        self.head_deadline.due = None
        # Bytes of the next request arrived while this one was served (pipelined, or a head
        # begun early): that head owes the deadline from now, not from a first byte that will
        # never come again (a client could stall it until keepalive_timeout otherwise).
        self.head_started = self.next_head
        if self.next_head:
            self.head_deadline.start(self.header_timeout)
        body = request.content
        self.body, self.unread = None, None if body.is_eof() else body
        if status == 408 and self.unread is not None:
            # Too slow to send its body: it will not finish while aiohttp lingers over it
            # (up to 10 s more). Close now.
            self.force_close()
        elif body.exception() is not None:
            # Its framing broke (400 body-invalid): aiohttp would linger over the rest of a body
            # whose reader holds the error, and log it as unhandled, with a traceback.
            self.force_close()
        elif self.switching:
            # What follows is never read: aiohttp would linger over it as an unread body (up to
            # 10 s) before closing, although the answer said `Connection: close`.
            self.force_close()
        elif request.version < HttpVersion11 and hdrs.TRANSFER_ENCODING in request.headers:
            # RFC 9112 §6.1: HTTP/1.0 with Transfer-Encoding has faulty framing: close after it
            # (aiohttp kept such a connection alive for the next request).
            self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        # SPEC §8: never echo raw attacker bytes. aiohttp's own page quotes the offending line,
        # and logs a traceback per malformed request (a cheap way to flood the logs).
        log.info("malformed request from %s refused with %d", request.remote, status)
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; no room for the 4xx")
        refused = self.refusable
        if refused is None or _may_hold_a_request_before_the_refused_bytes(refused):
            # aiohttp's parser takes one read as a unit: when it refuses bytes, the requests it
            # completed earlier in the same read are dropped with them, unanswered and never
            # run. A 400 now would be read as the answer to the first of them (SPEC §7: one
            # answer per request, and only its own). Closed without an answer instead: a client
            # retries the requests that a closed connection left unanswered (RFC 9112 §9.3.2).
            # So is a refusal whose bytes cannot be told to be the only request since the
            # connection was idle: they came in more than one read, or behind another request.
            log.info("malformed request from %s in a pipelined read: closed", request.remote)
            self.force_close()
            if self.transport is not None:
                self.transport.close()
            return _CLOSED
        # Written here, whole: a refusal before any request exists passes no application hook,
        # and aiohttp's own response would name it (`Server: Python/x aiohttp/y`, SPEC §10).
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if status == 400 and _names_a_header(exc):
                # SPEC §10: a second `Host` (or any repeated field that must be one) is
                # `header-invalid`, whether the parser or the handler finds it.
                line = f"HTTP/{request.version.major}.{request.version.minor} 400 Bad Request\r\n"
                refusal = line.encode("ascii") + _now() + _header_invalid(self.server_token)
            else:
                refusal = _refusal(request.version, status, self.server_token, _now())
            transport.write(refusal)
        self.force_close()
        return _CLOSED

    def _draining(self) -> bool:
        """Whether bytes are the rest of an unread body (aiohttp's lingering_time bounds it)."""
        if self.unread is not None and not self.unread.is_eof():
            return True
        self.unread = None
        return False

    def _head_timed_out(self) -> None:
        transport = self.transport
        if self.serving or transport is None or transport.is_closing():
            return
        if self.head_started:  # RFC 9110 §15.5.9; a connection that sent nothing just closes
            transport.write(_REQUEST_TIMEOUT_LINE + _now() + _request_timeout(self.server_token))
        self.force_close()


def _may_hold_a_request_before_the_refused_bytes(read: bytes) -> bool:
    """Whether the read in which the parser failed goes on past the first request in it: its
    head and the body its one Content-Length frames (none without one), or its chunked body's
    last chunk. Only the refused request, whatever its body holds, gets its own 400; so does
    one whose end cannot be told (a Content-Length missing its digits or given twice)."""
    end = read.find(b"\r\n\r\n", _past_empty_lines(read, 0))
    if end == -1:
        return False
    head = read[:end].lower()
    if b"\r\ntransfer-encoding:" in head:
        walk = ChunkWalk()
        last = walk.feed(read, end + 4)
        if last is None:
            return False  # the body goes on past this read: the refused bytes are its own
        if last == GAVE_UP:
            # Framing the walk refuses is this request's own (a 400 is its answer); a walk cut
            # short by its budget cannot tell what followed: closed, as where a 400 was not due.
            return walk.lines_out
        return last < len(read)
    field = head.find(b"\r\ncontent-length:")
    if field == -1:
        return end + 4 < len(read)
    if head.find(b"\r\ncontent-length:", field + 1) != -1:
        return False
    start = field + len(b"\r\ncontent-length:")
    stop = head.find(b"\r\n", start)
    value = head[start : len(head) if stop == -1 else stop].strip()
    return value.isdigit() and end + 4 + int(value) < len(read)


def _switches_to_websocket(head: RawRequestMessage) -> bool:
    """Whether aiohttp's parser hands what follows this request to it, as the WebSocket it
    switches to: with any other protocol, or a CONNECT, what followed may be lost."""
    # ASCII only, as the C parser reads it: Python's strip() and lower() take a no-break space
    # for a blank and the Kelvin sign for a `k`, and the parser would drop what follows.
    protocol = head.headers.get(hdrs.UPGRADE, "").strip(" \t")
    return (
        protocol.isascii() and protocol.lower() == "websocket" and head.method != hdrs.METH_CONNECT
    )


def _written(response: web.StreamResponse) -> None:
    if type(response) is NotifiedResponse:
        response.written()


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Client Error"


def _now() -> bytes:
    """The Date field of the proxy's own answers written here: an origin server with a clock
    sends one with every 4xx (RFC 9110 §6.6.1), as aiohttp does with the others."""
    return b"Date: " + formatdate(usegmt=True).encode("ascii") + b"\r\n"


def _refusal(version: HttpVersion, status: int, server_token: str, date: bytes) -> bytes:
    """A complete plain-text 4xx that closes the connection, in the version aiohttp hands over
    with its parser's error (1.0 for every head it refused, whatever the request line said),
    naming the proxy as its other answers do (SPEC §8: the offending bytes are never echoed;
    §10: the Server field)."""
    body = f"{status} {_phrase(status)}\n".encode("ascii")
    server = f"Server: {server_token}\r\n" if server_token else ""
    head = (
        f"HTTP/{version.major}.{version.minor} {status} {_phrase(status)}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"{server}Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
    )
    return head.encode("latin-1") + date + b"\r\n" + body


_REQUEST_TIMEOUT_LINE = b"HTTP/1.1 408 Request Timeout\r\n"
_EMPTY_LINE = b"\r\n"  # the bytes of empty lines, which begin no head (RFC 9112 §2.2)
_EMPTY_LINE_BYTES = (b"\r", b"\n")
_NOT_EMPTY_LINE = re.compile(rb"[^\r\n]")


def _past_empty_lines(data: bytes, at: int) -> int:
    """Where the request that begins at `at` has its first byte: empty lines before a request
    line are ignored (RFC 9112 §2.2), so their blank line is no end of its head."""
    if data[at : at + 1] not in _EMPTY_LINE_BYTES:
        return at  # nearly every request: no search
    begun = _NOT_EMPTY_LINE.search(data, at)
    return len(data) if begun is None else begun.start()


_TAIL = 16  # bytes of the stream's end kept (`tail`)
# A head that comes in more than one read is kept up to this size to be followed: aiohttp takes
# no head line over 8 KiB, and a head of more than a few such lines is rare.
_BURST_KEPT = 64 * 1024
_BURST_READS = 32  # reads joined at most: a head trickled in tiny reads is not copied each time


def _head_begun_after_chunks(tail: bytes) -> bool:
    """Whether a read that ended a chunked body, whose chunks were not followed, ends with bytes
    of a next head: anything but the body's closing blank line (`0` or a trailer field, CRLF,
    CRLF) and empty lines after it (RFC 9112 §2.2)."""
    stripped = tail.rstrip(b"\r\n")
    return bool(stripped) and not tail[len(stripped) :].startswith(b"\r\n\r\n")


def _names_a_header(exc: BaseException | None) -> bool:
    """Whether aiohttp's parser refused the head for a header field: one it cannot read, or one
    that must be single given twice. Its pure-Python parser says so by the exception's type;
    its C parser (llhttp) only in the message of a plain BadHttpMessage."""
    if isinstance(exc, InvalidHeader):
        return True
    if type(exc) is not BadHttpMessage:
        return False  # a request line, a line too long, a body's framing
    # llhttp's reason is the first line; the lines after it quote the client's bytes, which
    # must not decide the answer (a chunk size `zz-header` is no header field).
    reason = str(exc.message).partition("\n")[0].lower()
    return any(word in reason for word in _HEADER_WORDS)


_HEADER_WORDS = ("header", "content-length", "transfer-encoding")


@functools.cache
def _header_invalid(server_token: str) -> bytes:
    """A complete `400 header-invalid` problem response (SPEC §8, §10) but its status line and
    Date field, as `_request_timeout`."""
    return _problem_tail(HeaderInvalid("A header field is repeated or malformed."), server_token)


@functools.cache
def _request_timeout(server_token: str) -> bytes:
    """A complete 408 problem response (SPEC §8), written straight to the socket: all of it
    but its status line and Date field, which come before."""
    return _problem_tail(RequestTimeout("The request head did not arrive in time."), server_token)


def _problem_tail(error: ProblemError, server_token: str) -> bytes:
    """A problem response that closes the connection, from its first header field on. Made in
    an empty context: it is kept for every connection, so no request's id may be in it."""
    body = contextvars.Context().run(problem_response, error).body
    assert isinstance(body, bytes)
    server = f"Server: {server_token}\r\n" if server_token else ""
    head = (
        f"Content-Type: {PROBLEM_CONTENT_TYPE}\r\n"
        f"{ERROR_HEADER}: {error.code}\r\n"
        f"{server}Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


# The client-facing listener of `idemproxy serve`: aiohttp's low-level server (`web.Server`)
# calling the proxy's handler directly (`direct`: not through the app's router, which would
# resolve the one catch-all route and build a match info for every request), with connections
# served by `GuardedHandler` (the slow-client deadline, SPEC §9; quiet 400s, §8), accepted by
# the connection gate (proxy/server/gate.py), each request's head written by `HeadWriter`
# (header values byte for byte, SPEC §7, §10; what the app's prepare hooks do) and each whole
# response in one write (`serialise_whole`). Public aiohttp API only, so that any aiohttp 3.x
# from the oldest pyproject.toml admits serves it alike.


RequestHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
RequestFactory = Callable[
    [
        RawRequestMessage,
        StreamReader,
        web.RequestHandler,
        AbstractStreamWriter,
        "asyncio.Task[None]",
    ],
    web.BaseRequest,
]


def handler_options(settings: ServerSettings) -> dict[str, Any]:
    """The keyword arguments of each connection's handler: `idemproxy serve`'s limits."""
    return {
        "keepalive_timeout": settings.keepalive_timeout,
        "max_line_size": settings.max_line_size,
        "max_field_size": settings.max_field_size,
        "max_headers": settings.max_headers,
        # RFC 9110 §8.4: a content coding is the client's and the backend's business. With
        # aiohttp's default a gzip body was decompressed here and went on still labelled
        # gzip (tests/proxy/test_content_coding.py).
        "auto_decompress": False,
        "access_log": None,  # one log line per request costs more than the proxy itself
    }


ProxyHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


@dataclass(frozen=True, slots=True)
class ProxyRoute:
    """The proxy's handler and its handler of `Expect`, as its one route in the app's router
    has them (proxy/app.py puts them in the app as it starts: `PROXY_ROUTE`)."""

    handler: ProxyHandler
    expect_handler: ExpectHandler


PROXY_ROUTE = web.AppKey("idemproxy.proxy_route", ProxyRoute)


def direct(route: ProxyRoute) -> RequestHandler:
    """The request handler of the listener: what the app's router would do for the proxy's one
    route (proxy/server/any_path.py; aiohttp's `Expect` handling, its 404 for a target that is
    not the proxy's), then `route`'s handler, whose response the connection writes (`respond`)
    before aiohttp's loop sees it: the end of every request, whatever answered it."""
    handler, expect_handler = route.handler, route.expect_handler

    async def respond(request: web.Request) -> web.StreamResponse:
        protocol = request.protocol
        assert isinstance(protocol, GuardedHandler)
        response: web.StreamResponse | None = None
        try:
            request = routable(request)
            # Origin-form, nearly every request's, tested in place (one call less).
            if not request.raw_path.startswith("/") and not proxied(request):
                response = await unroutable(request)
            else:
                if request.headers.get(hdrs.EXPECT):
                    response = await expected(expect_handler, request)
                if response is None:  # a response is a mapping: never tested for truth
                    response = await handler(request)
        except web.HTTPException as exc:  # aiohttp's exceptions are responses
            response = exc
        except Exception:
            protocol.served(request, 500)  # aiohttp answers 500 and closes the connection
            raise
        return await protocol.respond(request, response)

    # The listener's request factory makes `web.Request`s (`requests_with_head_writer`).
    return cast(RequestHandler, respond)


async def expected(
    expect_handler: ExpectHandler, request: web.Request
) -> web.StreamResponse | None:
    """RFC 9110 §10.1.1, as aiohttp's app does it: the handler of `Expect` either refuses the
    request (its response) or lets it go on (None), with any interim response sent."""
    response = await expect_handler(request)
    await request.writer.drain()
    return response


async def unroutable(request: web.Request) -> web.StreamResponse:
    """What aiohttp's router answers a target that is not the proxy's (an authority-form
    target): its default handling of `Expect`, then 404."""
    expect = request.headers.get(hdrs.EXPECT)
    if expect and request.version == HttpVersion11:
        if expect.lower() != "100-continue":
            return web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim response is not part of the body's size
        await request.writer.drain()
    return web.HTTPNotFound()


def routable(request: web.Request) -> web.Request:
    """RFC 9112 §3.2.1: an absolute-form target without a path (`GET http://host?q`) asks for
    `/`. aiohttp's router finds no resource for an empty path, so such a request is handled as
    the same target with its `/` (`http://host/?q`), as it was when the router routed it, and
    which is what the proxy forwards anyway (`/?q`, http/headers.py). Any other request is handled
    as it came."""
    target = request.raw_path
    if target.startswith("/") or request.rel_url.path_safe:
        return request
    if asks_the_server(request.method, target):
        return request  # sent upstream as `*` (RFC 9112 §3.2.4), not as `/`
    absolute = split_absolute_form(target)
    if absolute is None:
        return request  # `OPTIONS *`, or an authority-form target: the router's 404
    scheme, authority, rest = absolute
    routed = request.clone(rel_url=f"{scheme}://{authority}{rest}")
    routed[TARGET_AS_SENT] = target  # the clone's is its URL's, without an empty query
    return routed


def requests_with_head_writer(loop: asyncio.AbstractEventLoop) -> RequestFactory:
    """The listener's request factory: a `web.Request` (what the app's factory makes, without
    its frame: the proxy reads no body through `client_max_size`, left at its default), with a
    writer that sends header values byte for byte and does what the app's prepare hooks do
    in place of aiohttp's, not used yet; and it tells the connection
    that a request's head was read."""

    def make(
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        _writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        writer = HeadWriter(protocol, loop)
        if isinstance(protocol, GuardedHandler):
            protocol.request_started(payload, message)
            writer.connection = protocol
        return web.Request(message, payload, protocol, writer, task, loop)

    return make


def close_idle_connections(server: web.Server) -> None:
    """SPEC §8, a shutdown: idle kept-alive connections close now, busy ones after their
    response, which says `Connection: close`."""
    for connection in server.connections:
        if isinstance(connection, GuardedHandler):
            connection.close_when_idle()
        else:  # not this listener's (tests): aiohttp's own graceful close
            connection.close()


def requests_begun(server: web.Server | None) -> bool:
    """Whether a connection of `server` is reading or serving a request, or holds bytes of a
    next one: a head that began before a shutdown is still read and answered (SPEC §8)."""
    if server is None:
        return False
    for connection in server.connections:
        if isinstance(connection, GuardedHandler) and connection.begun():
            return True
    return False


class GuardedSite:
    """A TCP listener for `runner`'s app, like `web.TCPSite`, whose connections are served by
    `GuardedHandler`, at most `limits.max_connections` at a time (counted in
    `metrics.client_connections`). Not one of `runner.sites`: `close` stops accepting,
    `stop` also closes its connections, before `runner.cleanup()`."""

    def __init__(
        self,
        runner: web.AppRunner,
        listen: str,
        settings: ServerSettings,
        limits: LimitsSettings,
        metrics: Metrics,
        *,
        reuse_port: bool = False,
    ) -> None:
        self.host, self.port = parse_listen(listen)
        self.runner = runner
        self.settings = settings
        self.limits = limits
        self.metrics = metrics
        # SO_REUSEPORT (set before bind by the event loop): the workers of one supervisor each
        # bind `listen`, and the kernel spreads new connections over them.
        self.reuse_port = reuse_port
        self.server: web.Server | None = None
        self.gate: ConnectionGate | None = None

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def addresses(self) -> list[Any]:
        """The bound addresses (`getsockname()`), as `runner.addresses` lists a TCPSite's."""
        return [] if self.gate is None else [sock.getsockname() for sock in self.gate.sockets]

    async def start(self) -> None:
        assert self.runner.server is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        server = web.Server(
            direct(self.runner.app[PROXY_ROUTE]),  # built as the app started
            request_factory=requests_with_head_writer(loop),
            handler_cancellation=False,  # SPEC §2: a client hanging up cancels nothing
        )
        options = handler_options(self.settings)
        header_timeout = self.settings.header_read_timeout
        server_token = self.settings.server_token

        def protocol(closed: Callable[[], None]) -> GuardedHandler:
            return GuardedHandler(
                server,
                loop=loop,
                header_timeout=header_timeout,
                server_token=server_token,
                on_closed=closed,
                **options,
            )

        sockets = listening_sockets(
            self.host, self.port, backlog=self.limits.backlog, reuse_port=self.reuse_port
        )
        gate = ConnectionGate(list(sockets), protocol, self.limits.max_connections)
        self.metrics.client_connections.set_function(lambda: gate.open)
        self.server, self.gate = server, gate

    def close(self) -> None:
        """Accept no more connections; those open go on."""
        if self.gate is not None:
            self.gate.close()

    async def accepted(self) -> None:
        """After `close`: until every connection accepted before it is set up and among the
        server's connections (a shutdown then sees each one, proxy/drain.py)."""
        if self.gate is not None:
            await self.gate.wait_closed()

    async def stop(self, shutdown_timeout: float = 1.0) -> None:
        """Accept no more connections, close idle ones, and give busy ones `shutdown_timeout`
        to finish their response before they are closed."""
        self.close()
        if self.gate is not None:
            await self.gate.wait_closed()
        server, self.server = self.server, None
        if server is not None:
            close_idle_connections(server)
            await server.shutdown(shutdown_timeout)


# One response per request on a connection, whatever the code above it returns (SPEC §7).
#
# HTTP/1.1 has no framing around a response but its own (RFC 9112 §6.3): bytes written after a
# response are read by the client as the answer to its next request on the connection, which,
# behind a load balancer that pools connections, may be another client's. A handler that streams
# its answer prepares it itself; if a bug then made it return a different response (a problem, a
# replay), aiohttp would write that one too. Here, instead, the connection is closed after the
# response that started: a truncated answer the client can tell from a whole one, never a second.
#
# Every head aiohttp writes is noted, so that the check does not depend on where in the proxy the
# response was started: on the listener of `idemproxy serve` by its writer (`HeadWriter`),
# which sees the head's fields but not the response; through the app's
# router (aiohttp's own servers: tests, the demo) by `note_started`, the app's
# `on_response_prepare` signal, which sees the response.


_STARTED = web.RequestKey("idemproxy_started_response", web.StreamResponse)


async def note_started(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: the response whose head is (about to be) written."""
    request[_STARTED] = response


def only_response(
    metrics: Metrics, request: web.Request, response: web.StreamResponse
) -> web.StreamResponse:
    """`response`, unless another one was started for this request: then that one (or, on the
    listener, what stands for it), with the connection closed, so that `response` is never
    written."""
    writer = request.writer
    if type(writer) is HeadWriter:  # the listener of `idemproxy serve`
        headers = writer.started_headers
        if headers is None or headers is response.headers:
            return response
        status = int(writer.started_line.split(" ", 2)[1])  # "HTTP/1.1 200 OK"
        # What aiohttp's loop gets instead: that response's status and fields, for the
        # request's log line and metrics; the connection is not kept.
        started: web.StreamResponse = SentResponse(persistent=False, status=status, headers=headers)
    else:
        # Only `note_started` puts anything in the request: an empty one started nothing.
        # Asked for a key it lacks, the request's `get` raises and catches a KeyError, on
        # every whole response (those never pass through the signal).
        noted: web.StreamResponse | None = request.get(_STARTED) if len(request) else None
        if noted is None or noted is response:
            return response
        started = noted
    _refuse_second(metrics, request, response, started)
    return started


def _refuse_second(
    metrics: Metrics,
    request: web.Request,
    response: web.StreamResponse,
    started: web.StreamResponse,
) -> None:
    metrics.second_responses.inc()
    log.error(
        "%s %s: a %d was returned after a %d had started; connection closed instead",
        request.method,
        redact_path(request.raw_path.partition("?")[0]),  # no query; no session id (SPEC §13)
        response.status,
        started.status,
    )
    started.force_close()
    if request.transport is not None:
        request.transport.close()


# Reading a governed request's body, bounded in size and time (SPEC §2.1, §9).
#
# Bodies up to `server.spool_threshold` stay in memory; larger ones go to an unnamed temporary
# file as they arrive (as nginx does), so that a hundred 10 MiB uploads do not cost a gigabyte of
# memory. Every attempt reads the file with positioned reads, so that racing attempts (hedging)
# never disturb each other.


_CHUNK = 64 * 1024


class RequestBody:
    def __init__(
        self,
        *,
        memory: bytes = b"",
        spool: BinaryIO | None = None,
        size: int = 0,
        raw_sha256: bytes = b"",
        form_sha256: bytes | None = None,
        form_media_type: str | None = None,
    ) -> None:
        # The body itself while it is held in memory; None once it is in a file, so that no
        # caller can take a spooled body for an empty one. Attributes, not properties: every
        # governed request reads them once or twice.
        self.memory: bytes | None = memory if spool is None else None
        self._spool = spool
        self.spooled = spool is not None
        self.size = size if spool is not None else len(memory)
        self.raw_sha256 = raw_sha256
        # A spooled body its client may encode anew for each try, hashed as the fingerprint
        # takes it (identity/intent.py `reencoding`), with the media type it hashes then.
        self.form_sha256, self.form_media_type = form_sha256, form_media_type
        if spool is not None:
            # Closed (and so deleted) when the last attempt using it is done.
            weakref.finalize(self, spool.close)

    def digest_by(self, form: Reencoding) -> bytes | None:
        """`form`'s digest of the spooled file, mapped into memory (run on a thread)."""
        if self._spool is None:
            raise ValueError("the body is held in memory")
        with mmap.mmap(self._spool.fileno(), self.size, access=mmap.ACCESS_READ) as mapped:
            mapped_body: Body = mapped
            return form.digest(mapped_body)

    def held(self) -> bytes:
        """The body, where a route holds every body in memory (`in_memory` bodies)."""
        if self.memory is None:
            raise ValueError("the body is spooled to disk")
        return self.memory

    def reader(self) -> AsyncIterator[bytes]:
        """A fresh reader of the spooled file, for one attempt: what to send upstream when
        `memory` is None (racing attempts each read it with their own offsets)."""
        if self._spool is None:
            raise ValueError("the body is held in memory")
        return self._chunks(self._spool.fileno())

    async def _chunks(self, fd: int) -> AsyncIterator[bytes]:
        offset = 0
        while offset < self.size:
            data = os.pread(fd, min(_CHUNK, self.size - offset), offset)
            if not data:
                return
            offset += len(data)
            yield data


async def read_body(
    request: web.Request, *, limit: int, timeout: float, spool_threshold: int
) -> RequestBody:
    """The whole body; 413 before any claim whether the length is declared or chunked."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLarge()
    content = request.content
    if content.is_eof():
        # The whole body is in aiohttp's buffer already (a small body arrives with its head):
        # nothing left to wait for, so no deadline to arm (SPEC §9) and one read takes it all.
        data = content.read_nowait()
        if len(data) <= limit and len(data) <= spool_threshold:  # `_buffered`'s common case
            return RequestBody(memory=data)
        return await _as_formed(request, _buffered(data, limit, spool_threshold))
    try:
        async with asyncio.timeout(timeout):
            body = await _receive(request, limit, spool_threshold)
    except TimeoutError as exc:
        raise RequestTimeout() from exc
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # A chunk's framing broken in a later read (SPEC §8); aiohttp's Python parser hands
        # on some of its errors wrapped in RequestPayloadError.
        raise BodyInvalid() from exc
    except ConnectionResetError as exc:
        # A client hanging up mid-body is routine (and cheap to do on purpose): one line, not
        # aiohttp's traceback at ERROR (proxy/handler.py logs and counts it).
        raise ClientDisconnected() from exc
    return body if body.memory is not None else await _as_formed(request, body)


def _buffered(data: bytes, limit: int, spool_threshold: int) -> RequestBody:
    """A body read whole: the same limit (a chunked one declared none) and spooling rules."""
    if len(data) > limit:
        raise BodyTooLarge()
    if len(data) <= spool_threshold:
        return RequestBody(memory=data)
    # Spooled even though it is in memory now: the attempts hold it for as long as they run.
    spool = _Spool()
    try:
        spool.write(data)
        return spool.body(len(data))
    except BaseException:
        spool.file.close()
        raise


async def _receive(request: web.Request, limit: int, spool_threshold: int) -> RequestBody:
    chunks: list[bytes] = []
    size = 0
    spool: _Spool | None = None
    try:
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge()
            if spool is None and size > spool_threshold:
                spool = _Spool()
                for held in chunks:
                    spool.write(held)
                chunks = []
            if spool is not None:
                spool.write(chunk)
            else:
                chunks.append(chunk)
        if spool is None:
            return RequestBody(memory=b"".join(chunks))
        return spool.body(size)
    except BaseException:
        if spool is not None:
            spool.file.close()
        raise


class _Spool:
    """A body going to disk, hashed as it arrives: what an attempt sends, named in its
    evidence, and what the fingerprint of a body hashed as sent takes."""

    def __init__(self) -> None:
        self.file: BinaryIO = tempfile.TemporaryFile()  # noqa: SIM115 - closed by RequestBody
        self._raw = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self._raw.update(chunk)
        self.file.write(chunk)

    def body(self, size: int) -> RequestBody:
        self.file.flush()
        return RequestBody(spool=self.file, size=size, raw_sha256=self._raw.digest())


async def _as_formed(request: web.Request, body: RequestBody) -> RequestBody:
    """A spooled body its client may encode anew for each try, with its digest as the
    fingerprint takes it (SPEC §6), worked out on a thread over the file mapped into memory:
    a body of megabytes, read whole once more."""
    headers = request.headers
    encoding = ",".join(headers.getall(hdrs.CONTENT_ENCODING, ()))
    form = reencoding(headers.get(hdrs.CONTENT_TYPE), encoding)
    if form is not None:
        digest = await asyncio.to_thread(body.digest_by, form)
        if digest is not None:
            body.form_sha256, body.form_media_type = digest, form.media_type
    return body
