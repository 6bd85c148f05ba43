"""A TCP relay that can black-hole the connections open through it (tests only).

`Relay(target_port)` listens on 127.0.0.1 and pipes each connection to the target. After
`blackhole()` every connection open at that moment stays open and silent: no byte moves in
either direction, nobody closes anything — what a client sees when a network path dies or a
failed-over server's address moves on without its sockets. Connections made afterwards relay
normally (the "new primary" answers).
"""

from __future__ import annotations

import asyncio
import contextlib


class Relay:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.Event] = set()  # one "frozen" flag per open connection
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, port: int = 0) -> None:
        """Listen on `port` (0: any free one)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def connections(self) -> int:
        """How many connections are open through the relay."""
        return len(self._open)

    def blackhole(self) -> None:
        for frozen in self._open:
            frozen.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        frozen = asyncio.Event()
        self._open.add(frozen)
        pumps = [
            asyncio.create_task(_pump(reader, up_writer, frozen)),
            asyncio.create_task(_pump(up_reader, writer, frozen)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
                self._tasks.discard(pump)
            self._open.discard(frozen)
            for stream in (writer, up_writer):
                stream.close()


async def _pump(
    source: asyncio.StreamReader, sink: asyncio.StreamWriter, frozen: asyncio.Event
) -> None:
    with contextlib.suppress(OSError):
        while data := await source.read(65536):
            if frozen.is_set():
                await asyncio.Event().wait()  # swallow it, and everything after it, forever
            sink.write(data)
            await sink.drain()
