"""One client connection read as raw bytes, each response parsed strictly (RFC 9112 §4, §6).

For the connection-integrity tests: a keep-alive connection carries responses back to back, and
a second status line in the middle of a body, or an answer written after the previous one
ended, shows up here as a response whose marker is another request's, or as stray bytes after
the last response. Nothing is tolerated: a status line that is not `HTTP/1.1 NNN …`, a header
line without a colon, a chunk size that is not hex, or bytes nobody asked for.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from multidict import CIMultiDict

MARKER = "X-Marker"
_STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*\r\n")
_NO_BODY = frozenset({204, 304})


@dataclass
class RawResponse:
    status: int
    headers: CIMultiDict[str]
    body: bytes
    whole: bool  # False: the connection ended before the framing said the body was complete
    raw_head: bytes = field(repr=False, default=b"")

    @property
    def marker(self) -> str | None:
        return self.headers.get(MARKER)


class RawConnection:
    """A client's one TCP connection to the proxy."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> RawConnection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    def send(
        self,
        method: str,
        path: str,
        *,
        marker: str,
        key: str | None = None,
        body: bytes = b"",
    ) -> None:
        lines = [f"{method} {path} HTTP/1.1", "Host: proxy", f"{MARKER}: {marker}"]
        if key is not None:
            lines.append(f"Idempotency-Key: {key}")
        lines.append(f"Content-Length: {len(body)}")
        self._writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body)

    async def response(self, *, method: str = "POST", timeout: float = 10.0) -> RawResponse:
        """The next response on the connection, read by its own framing only."""
        async with asyncio.timeout(timeout):
            return await self._read_response(method)

    async def quiet(self, seconds: float = 0.3) -> bytes:
        """Bytes that arrive within `seconds` though no request is outstanding (b"" is right)."""
        try:
            async with asyncio.timeout(seconds):
                return await self._reader.read(65536)
        except TimeoutError:
            return b""

    async def closed(self, timeout: float = 5.0) -> bool:
        """Whether the proxy ends the connection (EOF, or a reset) with no further byte."""
        try:
            async with asyncio.timeout(timeout):
                rest = await self._reader.read(65536)
        except ConnectionResetError:
            return True
        assert rest == b"", f"bytes after the last response: {rest[:200]!r}"
        return True

    def close(self) -> None:
        self._writer.close()

    async def _read_response(self, method: str) -> RawResponse:
        head = await self._reader.readuntil(b"\r\n\r\n")
        match = _STATUS_LINE.match(head)
        assert match is not None, f"not a status line: {head[:200]!r}"
        status = int(match.group(1))
        headers = _parse_headers(head[match.end() : -2])
        if status < 200:  # RFC 9110 §15.2: interim; the final response follows
            return await self._read_response(method)
        if method == "HEAD" or status in _NO_BODY:
            return RawResponse(status, headers, b"", True, head)
        body, whole = await self._read_body(headers)
        return RawResponse(status, headers, body, whole, head)

    async def _read_body(self, headers: CIMultiDict[str]) -> tuple[bytes, bool]:
        if headers.get("Transfer-Encoding", "").lower() == "chunked":
            assert "Content-Length" not in headers, "both Content-Length and chunked"
            return await self._read_chunked()
        lengths = headers.getall("Content-Length", [])
        if lengths:
            assert len(lengths) == 1 and lengths[0].isdigit(), lengths
            try:
                return await self._reader.readexactly(int(lengths[0])), True
            except asyncio.IncompleteReadError as cut:
                return cut.partial, False
        return await self._reader.read(-1), False  # RFC 9112 §6.3: until the close

    async def _read_chunked(self) -> tuple[bytes, bool]:
        body = bytearray()
        try:
            while True:
                size_line = await self._reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    trailer = await self._reader.readuntil(b"\r\n")
                    assert trailer == b"\r\n", f"trailers are not expected: {trailer!r}"
                    return bytes(body), True
                body += await self._reader.readexactly(size)
                assert await self._reader.readexactly(2) == b"\r\n", "chunk not ended by CRLF"
        except asyncio.IncompleteReadError as cut:
            return bytes(body) + cut.partial, False


def _parse_headers(block: bytes) -> CIMultiDict[str]:
    headers = CIMultiDict[str]()
    for line in block.split(b"\r\n"):
        if not line:
            continue
        name, colon, value = line.partition(b":")
        assert colon and name and name == name.strip(), f"not a header line: {line!r}"
        headers.add(name.decode("ascii"), value.strip().decode("latin-1"))
    return headers
