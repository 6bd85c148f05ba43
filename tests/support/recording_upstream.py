"""A bare TCP upstream that records the exact bytes of every request head it receives.

For the fidelity tests (SPEC §10): what reached the backend is read from the wire, not from a
framework that has already decoded the target or folded the headers. Each request is answered
`201` with an empty body, on a connection kept alive; bodies framed by Content-Length or chunked
are read and kept beside their head.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

_ANSWER = b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"


@dataclass(frozen=True)
class Received:
    head: bytes  # request line and header lines, up to and without the blank line
    body: bytes

    @property
    def target(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0].split(b" ")[1]

    def header_lines(self, name: str) -> list[bytes]:
        """The values of every `name` line, as sent (name matched case-insensitively)."""
        wanted = name.lower().encode() + b":"
        return [
            line[len(wanted) :].strip(b" \t")
            for line in self.head.split(b"\r\n")[1:]
            if line.lower().startswith(wanted)
        ]


@dataclass
class RecordingUpstream:
    received: list[Received] = field(default_factory=list)
    url: str = ""
    _server: asyncio.Server | None = None

    async def __aenter__(self) -> RecordingUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    @property
    def one(self) -> Received:
        [only] = self.received
        return only

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request = Received(head[:-4], await _body(reader, head))
                self.received.append(request)
                writer.write(_ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    fields = Received(head[:-4], b"")
    length = fields.header_lines("Content-Length")
    if length:
        return await reader.readexactly(int(length[0]))
    if fields.header_lines("Transfer-Encoding"):
        chunks = []
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            chunks.append((await reader.readexactly(size + 2))[:-2])
        await reader.readuntil(b"\r\n")
        return b"".join(chunks)
    return b""
