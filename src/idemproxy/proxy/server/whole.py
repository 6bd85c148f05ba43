"""Complete responses in one write, without aiohttp's machinery for streamed ones.

Most of the proxy's answers are whole: replays, problems, and the pass-through and governed
answers it read in full. aiohttp sends each of them through the path built for streaming
(`prepare`, the header preparation, the prepare signal, a payload writer, `write_eof`), six
coroutines deep: about 45,000 instructions a response, a fifth of aiohttp's own cost per request
(bench/findings.md). For a plain `web.Response` whose body is bytes, this module builds the same
bytes directly: the headers aiohttp would add, in the order it adds them, serialised as every
head of the listener is (proxy/server/whole.py: header values byte for byte; CR or LF in a status
line or header refused). Anything that needs more of that machinery (a streamed body, compression,
cookies, chunking, HEAD, a status without a body, a declared Content-Length, a Connection header
of the handler's) goes aiohttp's usual way.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any, Protocol

from aiohttp import HttpVersion, HttpVersion10, HttpVersion11, hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict

# Response heads as the client gets them: every header byte the upstream sent (SPEC §7, §10).
#
# Header values are text in the proxy as aiohttp makes them of a request's bytes, and as
# proxy/upstream/client.py makes them of an upstream's: UTF-8, with each byte that is not part of a
# UTF-8 sequence kept as a surrogate escape (`errors="surrogateescape"`). aiohttp's own serializer
# encodes plain UTF-8: its C version silently leaves the escapes out (`X-Name: caf\xe9` reached
# the client as `X-Name: caf`), its Python version raises. RFC 9110 §5.5 allows obs-text
# (0x80-0xFF) in a field value, and ISO-8859-1 servlet containers send it; so every response head
# of the proxy's listener is serialised here, with the codec the bytes were decoded with, and
# written by `HeadWriter` through the writer's public transport.
#
# The listener calls the proxy's handler without aiohttp's router (proxy/server/connection.py), so
# the app's `on_response_prepare` hooks (proxy/app.py) do not run for its responses: `HeadWriter`
# does what they do, for every head aiohttp prepares (a streamed answer, one of aiohttp's own
# error pages), just before it writes it.


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
    """What a head needs of the listener's connection (proxy/server/connection.py)."""

    @property
    def closing(self) -> bool:
        """A shutdown began: the connection closes after this response (SPEC §8)."""

    @property
    def server_token(self) -> str:
        """The Server field of the proxy's own answers (SPEC §10)."""


class HeadWriter(StreamWriter):
    """aiohttp's payload writer, with the head serialised by `serialise_head` and written at
    once (aiohttp 3.12 and later hold it back to send it with the first body bytes; a whole
    response, the common case, is one write anyway: proxy/server/whole.py).

    One per request. On `connection`'s requests a head also gets what the app's prepare hooks
    would give it: its Server field (`name_server`), `Connection: close` once a shutdown began,
    and it is noted (`started_headers`: the headers of the response whose head went out, so
    that no other response follows it, proxy/server/connection.py)."""

    # Class defaults, not an __init__ of its own: one writer is made per request.
    connection: ServingConnection | None = None
    # Set by an upstream's response as it prepares (proxy/server/whole.py): the fields aiohttp
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
    to the listener's writer too, which takes them out again (proxy/server/whole.py)."""
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
