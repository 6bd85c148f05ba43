"""A TCP relay to PostgreSQL that delivers the server's answers late (tests only)."""

from __future__ import annotations

import asyncio
import struct
import time
from urllib.parse import urlsplit

# The frontend messages that start a statement's run (PostgreSQL protocol 3.0, "Message
# Formats"): Bind, on the extended protocol, and Query, on the simple one.
_RUNS = frozenset(b"BQ")
_STARTUP_CODE = 196608  # protocol 3.0: the last message without a type byte


class SlowReplies:
    """A TCP relay to PostgreSQL that delivers the server's bytes `delay` seconds after they
    arrived (in order, per connection): a statement runs and commits at once, and its answer
    comes after its timeout, as on a congested network."""

    def __init__(self, dsn: str) -> None:
        self.target = urlsplit(dsn)
        self.delay = 0.0
        self._armed: tuple[float, float] | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    def delay_next_run(self, delay: float, *, lasting: float) -> None:
        """From the next statement run sent on any connection on (not a statement being prepared
        first: its answer comes at once), the server's bytes are delivered `delay` late, for
        `lasting` seconds."""
        self._armed = (delay, lasting)

    def _runs(self, messages: _Frontend, chunk: bytes) -> None:
        if messages.saw_run(chunk) and self._armed is not None:
            self.delay, lasting = self._armed
            self._armed = None
            asyncio.get_running_loop().call_later(lasting, setattr, self, "delay", 0.0)

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
        messages = _Frontend()
        while chunk := await source.read(65536):
            self._runs(messages, chunk)
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


class _Frontend:
    """Where the client's messages begin, across chunks: the untyped ones up to the startup
    message (an SSL or GSS request before it), then a type byte and a length each."""

    def __init__(self) -> None:
        self.started = False
        self.pending = b""  # the start of a message header split across chunks
        self.skip = 0  # the bytes of the current message still to come

    def saw_run(self, chunk: bytes) -> bool:
        data, found = self.pending + chunk, False
        self.pending = b""
        at = min(self.skip, len(data))
        self.skip -= at
        while at < len(data):
            header = 4 if not self.started else 5
            if len(data) - at < header + (4 if not self.started else 0):
                self.pending = data[at:]
                break
            if not self.started:
                length, code = struct.unpack_from("!ii", data, at)
                self.started = code == _STARTUP_CODE
            else:
                found = found or data[at] in _RUNS
                length = struct.unpack_from("!i", data, at + 1)[0] + 1
            end = at + length
            self.skip = max(end - len(data), 0)
            at = min(end, len(data))
        return found
