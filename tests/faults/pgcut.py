"""A TCP relay to PostgreSQL that cuts a connection once the server committed a given statement
(tests only): the answer the client never gets, after the server did the work.

`StatementCut(target_port)` listens on 127.0.0.1 and pipes each connection to the server,
reading both directions as the PostgreSQL frontend/backend protocol (version 3.0, without TLS:
the DSN says `sslmode=disable`) just enough to follow the extended query protocol: `Parse`
names a prepared statement and carries its text, `Bind` runs it. After `arm(sql)`, the first
`Bind` of a statement whose text is `sql` dooms its connection: the server's answers from then
on are held back, and at the `ReadyForQuery` that reports the transaction ended (status `I`,
after no `ErrorResponse`) the relay closes both sides instead of passing them on. The statement
committed; the client sees its connection lost while it waits for the answer. A doomed
connection whose statement failed is passed on whole (`failed` counts it). Connections made
afterwards relay normally. `arm(sql, unsent=True)` cuts the connection at that `Bind` instead,
before the server gets it: the statement never ran, and the client cannot tell.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field

_HEADER = struct.Struct("!cI")  # a message's type and its length (which counts itself)
_READY_FOR_QUERY, _ERROR, _PARSE, _BIND = b"Z", b"E", b"P", b"B"
_IDLE = b"I"  # ReadyForQuery: not in a transaction block (the last one ended)


@dataclass
class _Connection:
    """One client's session: its prepared statements' texts and whether it is doomed."""

    statements: dict[bytes, bytes] = field(default_factory=dict)
    doomed: bool = False
    errored: bool = False
    held: bytearray = field(default_factory=bytearray)


class StatementCut:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cuts = 0  # connections cut after their statement committed
        self.failed = 0  # doomed connections whose statement failed: relayed, not cut
        self._armed: bytes | None = None
        self._unsent = False  # cut at the armed statement's Bind, before the server has it
        self._cut = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def arm(self, sql: str, *, unsent: bool = False) -> None:
        """Cut the connection that runs `sql` next, once the server committed it (`unsent`:
        before the server receives it)."""
        self._armed, self._unsent = sql.encode(), unsent
        self._cut.clear()

    async def cut(self, timeout: float = 10.0) -> None:
        """Until the armed statement's connection was cut."""
        await asyncio.wait_for(self._cut.wait(), timeout)

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
        session = _Connection()
        pumps = [
            asyncio.create_task(self._requests(session, reader, up_writer)),
            asyncio.create_task(self._answers(session, up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
                self._tasks.discard(pump)
            for stream in (writer, up_writer):
                stream.close()

    async def _requests(
        self, session: _Connection, source: asyncio.StreamReader, sink: asyncio.StreamWriter
    ) -> None:
        """Client to server: the startup message (untyped), then typed messages."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            (length,) = struct.unpack("!I", await source.readexactly(4))
            sink.write(struct.pack("!I", length) + await source.readexactly(length - 4))
            while True:
                kind, message = await _message(source)
                self._observe(session, kind, message[_HEADER.size :])
                if session.doomed and self._unsent:
                    self.cuts += 1
                    self._cut.set()
                    return  # the connection closes before the server had the statement
                sink.write(message)
                await sink.drain()

    def _observe(self, session: _Connection, kind: bytes, payload: bytes) -> None:
        if kind == _PARSE:  # statement name, NUL, query text, NUL, ...
            name, text, _ = payload.split(b"\x00", 2)
            session.statements[name] = text
        elif kind == _BIND and self._armed is not None:  # portal, NUL, statement name, NUL, ...
            _, name, _ = payload.split(b"\x00", 2)
            if session.statements.get(name) == self._armed:
                self._armed = None
                session.doomed, session.errored = True, False

    async def _answers(
        self, session: _Connection, source: asyncio.StreamReader, sink: asyncio.StreamWriter
    ) -> None:
        """Server to client, every message typed (no TLS negotiation: `sslmode=disable`)."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                kind, message = await _message(source)
                if not session.doomed:
                    sink.write(message)
                    await sink.drain()
                    continue
                session.held += message
                session.errored |= kind == _ERROR
                if kind != _READY_FOR_QUERY:
                    continue
                if message[-1:] == _IDLE and not session.errored:
                    self.cuts += 1
                    self._cut.set()
                    return  # the connection closes without the answer
                if session.errored:  # the statement failed: nothing to cut
                    self.failed += 1
                    session.doomed = False
                sink.write(bytes(session.held))  # in a transaction block: wait for its end
                session.held.clear()
                await sink.drain()


async def _message(source: asyncio.StreamReader) -> tuple[bytes, bytes]:
    header = await source.readexactly(_HEADER.size)
    kind, length = _HEADER.unpack(header)
    return kind, header + await source.readexactly(length - 4)
