"""A TCP relay to PostgreSQL that delivers the server's answers late (tests only)."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit


class SlowReplies:
    """A TCP relay to PostgreSQL that delivers the server's bytes `delay` seconds after they
    arrived (in order, per connection): a statement runs and commits at once, and its answer
    comes after its timeout, as on a congested network."""

    def __init__(self, dsn: str) -> None:
        self.target = urlsplit(dsn)
        self.delay = 0.0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        netloc = self.target.netloc.rsplit("@", 1)
        user = netloc[0] + "@" if len(netloc) == 2 else ""
        return self.target._replace(netloc=f"{user}127.0.0.1:{port}").geturl()

    async def __aexit__(self, *_exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Both ends of every relayed connection, closed here whatever the pumps reached: a
        # socket left to the garbage collector warns in whichever test runs next.
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for w in self._writers), return_exceptions=True)
        await self._server.wait_closed()

    async def _relay(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        self._writers.append(client_out)
        server_in, server_out = await asyncio.open_connection(
            self.target.hostname, self.target.port or 5432
        )
        self._writers.append(server_out)
        replies: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        for work in (
            self._pump(client_in, server_out),
            self._hold(server_in, replies),
            self._deliver(replies, client_out),
        ):
            task = asyncio.create_task(work)
            self._tasks.add(task)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while chunk := await source.read(65536):
            sink.write(chunk)
            await sink.drain()
        sink.close()

    async def _hold(
        self, source: asyncio.StreamReader, replies: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        while chunk := await source.read(65536):
            replies.put_nowait((time.monotonic() + self.delay, chunk))
        replies.put_nowait((0.0, b""))

    async def _deliver(
        self, replies: asyncio.Queue[tuple[float, bytes]], sink: asyncio.StreamWriter
    ) -> None:
        while True:
            due, chunk = await replies.get()
            if not chunk:
                sink.close()
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            sink.write(chunk)
            await sink.drain()
