"""An upstream that answers raw bytes (a fake API, named as such): any status line, header bytes
and body, which no HTTP server library would let a test send (undecodable header values, a
JSON body with a lone surrogate escape, nesting 100,000 deep).

`answers` maps a request path to the raw answer; each path's calls are counted, and `executions`
counts those answered with anything but a `503` (the proxy releases a 503 and runs the request
again, SPEC §3.2): a paid-for execution.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RawAnswer:
    status: int = 200
    headers: tuple[bytes, ...] = ()  # whole header lines, without CRLF
    body: bytes = b""
    flaky: bool = False  # the first call answers 503 with Retry-After: 0
    delay: float = 0.0  # seconds before the answer (the first call only)

    def encode(self, first_call: bool) -> bytes:
        if self.flaky and first_call:
            return _response(503, (b"Retry-After: 0",), b"")
        return _response(self.status, self.headers, self.body)


def _response(status: int, headers: tuple[bytes, ...], body: bytes) -> bytes:
    head = [b"HTTP/1.1 %d Scripted" % status, *headers, b"Content-Length: %d" % len(body)]
    return b"\r\n".join([*head, b"Connection: close", b"", b""]) + body


@dataclass
class RawUpstream:
    answers: dict[str, RawAnswer] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    executions: Counter[str] = field(default_factory=Counter)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            path = await _read_request(reader)
            answer = self.answers.get(path, RawAnswer(404))
            self.calls[path] += 1
            first = self.calls[path] == 1
            if not (answer.flaky and first):
                self.executions[path] += 1
            if first and answer.delay:
                await asyncio.sleep(answer.delay)
            writer.write(answer.encode(first))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> str:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    return lines[0].split(" ")[1]


@contextlib.asynccontextmanager
async def raw_upstream(
    upstream: RawUpstream, port: int = 0
) -> AsyncIterator[tuple[RawUpstream, str]]:
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", port)
    try:
        yield upstream, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()
