"""The upstream client (SPEC §10): pooled keep-alive, no decompression, no silent re-sends.

This module is the one boundary where the upstream leg's errors become `UpstreamFailure`; the
HTTP/1.1 work itself is in `proxy/upstream/h1.py`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from yarl import URL

from idemproxy.core.attempts import Failure
from idemproxy.proxy.upstream.h1 import (
    ONE_WRITE,
    Connection,
    ConnectionPool,
    Origin,
    UpstreamFailure,
    UpstreamResponse,
    framing_for,
    request_head,
    send_stream,
)

__all__ = ["UpstreamClient", "UpstreamFailure", "UpstreamResponse"]
log = logging.getLogger(__name__)
_DEFAULT_PORTS = {"http": 80, "https": 443}


class UpstreamClient:
    def __init__(
        self,
        *,
        timeout: float,
        connect_timeout: float,
        connections: int,
        keepalive: float,
        on_sent: Callable[[], None] | None = None,
        on_headers_dropped: Callable[[int], None] | None = None,
    ) -> None:
        """`on_headers_dropped(n)`: n fields of a response head were left out (SPEC §10)."""
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._connections = connections
        self._keepalive = keepalive
        # Test-only (proxy/failpoints.py): called once the request's bytes are on the wire.
        self._on_sent = on_sent
        self._on_dropped = on_headers_dropped
        self._pool: ConnectionPool | None = None
        self._origins: dict[tuple[str | None, str | None, int | None], tuple[Origin, str]] = {}

    async def open(self) -> None:
        self._pool = ConnectionPool(
            limit=self._connections,
            keepalive=self._keepalive,
            ssl=ssl.create_default_context(),
        )

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def request(
        self,
        method: str,
        url: URL,  # encoded=True: its path and query go out byte for byte (SPEC §10 fidelity)
        headers: Any,
        body: bytes | AsyncIterable[bytes] | None,
        *,
        content_length: int | None = None,
    ) -> Exchange:
        """`async with client.request(…) as response`: sends the request and gives the response
        once its head arrived; leaving the block gives the connection back."""
        if self._pool is None:
            raise RuntimeError("UpstreamClient.open() was not called")
        origin, host = self._origin(url)
        framing = framing_for(method, body, content_length)
        return Exchange(
            self._pool,
            origin,
            method,
            request_head(method, url.raw_path_qs, host, headers, framing),
            body,
            chunked=framing.startswith("Transfer-Encoding"),
            content_length=content_length,
            connect_timeout=self._connect_timeout,
            timeout=self._timeout,
            on_sent=self._on_sent,
            on_dropped=self._on_dropped,
        )

    def _origin(self, url: URL) -> tuple[Origin, str]:
        """(host, port, TLS) and the Host header for an upstream URL; cached per upstream."""
        cache_key = (url.scheme, url.raw_host, url.port)
        found = self._origins.get(cache_key)
        if found is None:
            if url.scheme not in _DEFAULT_PORTS or not url.raw_host:
                raise UpstreamFailure(Failure.CONNECT, f"unsupported upstream URL: {url}")
            port = url.port or _DEFAULT_PORTS[url.scheme]
            host = url.raw_host
            # RFC 9110 §7.2: the port is left out when it is the scheme's default.
            authority = f"[{host}]" if ":" in host else host
            if url.explicit_port and port != _DEFAULT_PORTS[url.scheme]:
                authority = f"{authority}:{port}"
            found = ((host, port, url.scheme == "https"), authority)
            self._origins[cache_key] = found
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


class Exchange:
    """One request and its response on a pooled connection (`UpstreamClient.request`). A class
    rather than a generator context manager: it runs for every request, and a generator's frame
    and its `asynccontextmanager` wrapper cost more than the two methods."""

    __slots__ = (
        "_body",
        "_chunked",
        "_connect_timeout",
        "_connection",
        "_content_length",
        "_head",
        "_method",
        "_on_dropped",
        "_on_sent",
        "_origin",
        "_pool",
        "_sender",
        "_timeout",
    )

    def __init__(
        self,
        pool: ConnectionPool,
        origin: Origin,
        method: str,
        head: bytes,
        body: bytes | AsyncIterable[bytes] | None,
        *,
        chunked: bool,
        content_length: int | None,
        connect_timeout: float,
        timeout: float,
        on_sent: Callable[[], None] | None,
        on_dropped: Callable[[int], None] | None = None,
    ) -> None:
        self._pool = pool
        self._origin = origin
        self._method = method
        self._head = head
        self._body = body
        self._chunked = chunked
        self._content_length = content_length
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._on_sent = on_sent
        self._on_dropped = on_dropped
        self._connection: Connection | None = None
        self._sender: asyncio.Task[None] | None = None

    async def __aenter__(self) -> UpstreamResponse:
        connection = await self._pool.acquire(self._origin, self._connect_timeout)
        self._connection = connection
        exchange = UpstreamResponse(connection, self._method, self._timeout)
        connection.exchange = exchange
        body = self._body
        try:
            if body is None or isinstance(body, bytes | bytearray):
                self._send_whole(connection, exchange, bytes(body or b""))
            else:
                connection.write(self._head)
                self._sender = asyncio.create_task(
                    send_stream(
                        connection,
                        exchange,
                        body,
                        chunked=self._chunked,
                        content_length=self._content_length,
                        on_sent=self._on_sent,
                    )
                )
            await exchange.wait_head()
        except BaseException as exc:
            self._finish()
            if isinstance(exc, ConnectionError | OSError):
                raise UpstreamFailure(Failure.BROKEN, f"upstream connection broke: {exc}") from exc
            raise
        if exchange.dropped_headers:
            self._report_dropped(exchange.dropped_headers)
        return exchange

    def _report_dropped(self, names: list[str]) -> None:
        host, port, _ = self._origin
        # Names only: a value may be anything, and is what made the field invalid.
        log.warning(
            "upstream %s:%d sent a control character in header(s) %s: left out (SPEC §10)",
            host,
            port,
            ", ".join(names),
        )
        if self._on_dropped is not None:
            self._on_dropped(len(names))

    async def __aexit__(self, *_exc: object) -> None:
        self._finish()

    def _send_whole(self, connection: Connection, exchange: UpstreamResponse, body: bytes) -> None:
        if len(body) <= ONE_WRITE:
            connection.write(self._head + body)
        else:
            connection.writelines((self._head, body))
        exchange.request_sent = True
        if self._on_sent is not None:
            connection.loop.call_soon(self._on_sent)

    def _finish(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        sender = self._sender
        if sender is not None and not sender.done():
            sender.cancel()  # answered before the whole body was sent: not reusable
            connection.abort()
        self._pool.release(self._origin, connection)
