"""A fault-injecting TCP relay (a fake network, named as such): it resets chosen connections.

Every connection is relayed byte for byte to the target, except that on the connections whose
number is in `reset` (1-based, in accept order), as soon as the first byte of an answer comes
back — the request was forwarded and executed — the client's side is reset (RST, as a dropped
connection looks) and the answer is thrown away: the lost response of SPEC §1 and the seed
article's `ConnectionResetError(104, 'Connection reset by peer')`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable
from typing import Any


class ResettingRelay:
    def __init__(self, host: str, port: int, reset: set[int]) -> None:
        self._target = (host, port)
        self._reset = reset
        self.handlers: set[asyncio.Task[None]] = set()
        self.connections = 0
        self.resets = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        try:
            if number in self._reset:
                answer = asyncio.ensure_future(up_reader.read(1))
                await _until_first(_pipe(reader, up_writer), answer)
                if answer.done() and answer.result():
                    self.resets += 1
                    _reset(writer)
            else:
                await _until_first(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.transport.abort()
            writer.transport.abort()
            self.handlers.discard(task)


async def _until_first(*aws: Awaitable[Any]) -> None:
    """Run both directions until one ends (a side closed), then stop the other."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@contextlib.asynccontextmanager
async def resetting_relay(
    target: str, reset: set[int]
) -> AsyncIterator[tuple[ResettingRelay, str]]:
    host, port = target.removeprefix("http://").rsplit(":", 1)
    relay = ResettingRelay(host, int(port), reset)
    server = await asyncio.start_server(relay.handle, "127.0.0.1", 0)
    try:
        yield relay, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for handler in list(relay.handlers):
            handler.cancel()
        await asyncio.gather(*relay.handlers, return_exceptions=True)
        await server.wait_closed()
