"""The upstream client (SPEC §10): pooled keep-alive, no decompression, no silent re-sends.

This module is the one boundary where aiohttp's client errors become `UpstreamFailure`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any

import aiohttp
from yarl import URL

from idemproxy.decision import Failure


class UpstreamFailure(Exception):
    """The upstream call failed; `failure` says how far the request got (SPEC §3.2)."""

    def __init__(self, failure: Failure, reason: str) -> None:
        super().__init__(reason)
        self.failure = failure
        self.reason = reason


class UpstreamClient:
    def __init__(
        self,
        *,
        timeout: float,
        connect_timeout: float,
        connections: int,
        keepalive: float,
        trace_configs: Sequence[aiohttp.TraceConfig] = (),
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=connect_timeout)
        self._connections = connections
        self._keepalive = keepalive
        self._trace_configs = list(trace_configs)
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._connections, keepalive_timeout=self._keepalive, ttl_dns_cache=60
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,  # SPEC §7: bodies byte-identical
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            raise_for_status=False,
            trace_configs=self._trace_configs or None,
        )
        # SPEC §10: never re-send a request on a pooled connection once any byte may have been
        # written. aiohttp retries idempotent methods after a disconnect on a reused connection
        # (client.py, "retry_persistent_connection") and has no public switch for it; its own
        # test client turns it off the same way.
        self._session._retry_connection = False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: URL,  # encoded=True; a str would be re-quoted by aiohttp (SPEC §10 fidelity)
        headers: Any,
        body: bytes | AsyncIterable[bytes] | None,
        *,
        content_length: int | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send the request; yields the response once its headers arrived."""
        if self._session is None:
            raise RuntimeError("UpstreamClient.open() was not called")
        if content_length is not None and not isinstance(body, bytes):
            headers["Content-Length"] = str(content_length)
        try:
            async with self._session.request(
                method,
                url,
                headers=headers,
                data=body,
                allow_redirects=False,
                compress=None,
                chunked=None,
            ) as response:
                yield response
        except aiohttp.ClientError as exc:
            raise classify(exc) from exc
        except TimeoutError as exc:
            raise UpstreamFailure(Failure.TIMEOUT, "upstream timed out") from exc

    @staticmethod
    async def read_body(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
        """Up to `limit` bytes of the body; the flag says whether all of it fits."""
        chunks: list[bytes] = []
        size = 0
        try:
            while size <= limit:
                chunk = await response.content.readany()
                if not chunk:
                    return b"".join(chunks), True
                chunks.append(chunk)
                size += len(chunk)
        except aiohttp.ClientError as exc:
            raise classify(exc) from exc
        except TimeoutError as exc:
            raise UpstreamFailure(Failure.TIMEOUT, "upstream body timed out") from exc
        return b"".join(chunks), False

    @staticmethod
    async def iter_body(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.content.iter_any():
                yield chunk
        except aiohttp.ClientError as exc:
            raise classify(exc) from exc
        except TimeoutError as exc:
            raise UpstreamFailure(Failure.TIMEOUT, "upstream body timed out") from exc


def classify(exc: aiohttp.ClientError) -> UpstreamFailure:
    """How far a failed request got (SPEC §3.2)."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        # Refused, DNS, TLS handshake, or no connection within the connect timeout:
        # not one byte of the request was written.
        return UpstreamFailure(Failure.CONNECT, f"connect failed: {type(exc).__name__}")
    if isinstance(exc, asyncio.TimeoutError):
        return UpstreamFailure(Failure.TIMEOUT, "upstream timed out")
    return UpstreamFailure(Failure.BROKEN, f"upstream connection broke: {type(exc).__name__}")
