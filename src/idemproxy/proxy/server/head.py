"""Response heads as the client gets them: every header byte the upstream sent (SPEC §7, §10).

Header values are text in the proxy as aiohttp makes them of a request's bytes, and as
proxy/upstream/h1.py makes them of an upstream's: UTF-8, with each byte that is not part of a UTF-8
sequence kept as a surrogate escape (`errors="surrogateescape"`). aiohttp's own serializer
encodes plain UTF-8: its C version silently leaves the escapes out (`X-Name: caf\\xe9` reached
the client as `X-Name: caf`), its Python version raises. RFC 9110 §5.5 allows obs-text
(0x80-0xFF) in a field value, and ISO-8859-1 servlet containers send it; so every response head
of the proxy's listener is serialised here, with the codec the bytes were decoded with, and
written by `HeadWriter` through the writer's public transport.

The listener calls the proxy's handler without aiohttp's router (proxy/server/listener.py), so
the app's `on_response_prepare` hooks (proxy/app.py) do not run for its responses: `HeadWriter`
does what they do, for every head aiohttp prepares (a streamed answer, one of aiohttp's own
error pages), just before it writes it.
"""

from __future__ import annotations

import re
from typing import Protocol

from aiohttp import hdrs
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict

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
    that no other response follows it, proxy/server/one_response.py)."""

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
