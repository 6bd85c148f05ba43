"""The upstream client (SPEC §10): pooled keep-alive, no decompression, no silent re-sends.

This module is the one boundary where the upstream leg's errors become `UpstreamFailure`; the
HTTP/1.1 connections and the answer's parsing are in `proxy/upstream/h1.py`; the request's
head is written here (`request_head`), where its one caller is.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from yarl import URL

from idemproxy.core.attempts import Failure
from idemproxy.proxy.upstream.dial import Dialing
from idemproxy.proxy.upstream.h1 import (
    NO_HOOKS,
    ConnectionPool,
    Exchange,
    Link,
    Origin,
    StreamedBody,
    UpstreamFailure,
    UpstreamHooks,
    UpstreamResponse,
)

__all__ = ["UpstreamClient", "UpstreamFailure", "UpstreamHooks", "UpstreamResponse"]
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
        in `headers` (a CIMultiDict; SPEC §10 `forward_host`, proxy/upstream/target.py), by
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
        head = request_head(method, target, host, headers, framing)
        wait = self._timeout if timeout is None else timeout
        if body is None or isinstance(body, bytes | bytearray):
            return Exchange(self._link, origin, method, head, body, wait)
        return Exchange(self._link, origin, method, head, StreamedBody(body, content_length), wait)

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
    breaks = len(lines) + 1 - (framing == "")
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
