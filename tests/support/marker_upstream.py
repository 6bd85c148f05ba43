"""A bare TCP upstream that echoes each request's marker, with a scripted behaviour per path.

For the connection-integrity tests: every answer carries the request's `X-Marker` header back
(and starts its body with it), so a client can tell which request a response answers. What the
upstream does is chosen by the request path, from the `plays` it was given (default `answer()`):

  answer(status, size, delay, chunk, pace, chunked)  wait `delay`, send the head, then the body
      of `size` bytes in pieces of `chunk` every `pace` seconds (Content-Length, or chunked)
  cut(after, declared, wait)  a 200 that declares `declared` bytes, sends `after` of them,
      and closes `wait` seconds later
  reset()       read the request, then reset the connection (no byte of an answer)

Each upstream keeps its connections alive between requests, as backends do, and records the
markers it received, in order, so a test can count executions.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Play = Callable[[asyncio.StreamWriter, str, str], Awaitable[bool]]  # -> keep the connection


def body_for(marker: str, name: str, size: int) -> bytes:
    start = f"{marker}|{name}|".encode("ascii")
    return (start + b"." * max(size - len(start), 0))[: max(size, len(start))]


def _head(status: int, marker: str, name: str, framing: str) -> bytes:
    return (
        f"HTTP/1.1 {status} Scripted\r\nContent-Type: text/plain\r\nX-Marker: {marker}\r\n"
        f"X-Upstream: {name}\r\n{framing}\r\n"
    ).encode("ascii")


def answer(
    status: int = 200,
    *,
    size: int = 40,
    delay: float = 0.0,
    chunk: int = 0,
    pace: float = 0.0,
    chunked: bool = False,
) -> Play:
    async def play(writer: asyncio.StreamWriter, marker: str, name: str) -> bool:
        await asyncio.sleep(delay)
        body = body_for(marker, name, size)
        length = f"Content-Length: {len(body)}\r\n"
        framing = "Transfer-Encoding: chunked\r\n" if chunked else length
        writer.write(_head(status, marker, name, framing))
        step = chunk or len(body)
        for start in range(0, len(body), step):
            if start:
                await asyncio.sleep(pace)
            piece = body[start : start + step]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    return play


def cut(after: int, declared: int = 20_000, *, wait: float = 0.05) -> Play:
    async def play(writer: asyncio.StreamWriter, marker: str, name: str) -> bool:
        writer.write(_head(200, marker, name, f"Content-Length: {declared}\r\n"))
        writer.write(body_for(marker, name, after))
        await writer.drain()
        await asyncio.sleep(wait)
        return False

    return play


def reset() -> Play:
    async def play(writer: asyncio.StreamWriter, marker: str, name: str) -> bool:
        sock = writer.get_extra_info("socket")
        # SO_LINGER 0: close() sends RST instead of FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False

    return play


@dataclass
class MarkerUpstream:
    name: str
    plays: dict[str, Play] = field(default_factory=dict)
    received: list[str] = field(default_factory=list)
    url: str = ""
    _server: asyncio.Server | None = None

    async def start(self) -> MarkerUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def count(self, marker: str) -> int:
        return self.received.count(marker)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                path, headers = _parse_request(head)
                await reader.readexactly(int(headers.get("content-length", "0")))
                marker = headers.get("x-marker", "")
                self.received.append(marker)
                play = self.plays.get(path, answer())
                if not await play(writer, marker, self.name):
                    return
        except ConnectionError:
            return
        finally:
            writer.close()


def _parse_request(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    path = lines[0].split(" ")[1].split("?", 1)[0]
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return path, headers
