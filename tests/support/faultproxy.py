"""A fault-injecting TCP relay between the proxy and a backend (tests only).

`FaultProxy` listens on 127.0.0.1 and relays each connection to the backend one exchange at a
time: it reads a request (head, then a `Content-Length` body), sends it to the backend, reads the
backend's whole response, and hands that to the client as the next queued `Fault` says. The
backend really executes every request the relay forwards, so its ledger tells what ran.

  PASS                   the response as it came
  REFUSE                 (`refuse()`) the port refuses connections: no byte of a request sent
  RESET_ON_ACCEPT        accept, then reset before reading: the request may have been written
  RESET_BEFORE_RESPONSE  forward the request, wait for the backend's answer, then reset
  RESET_MID_BODY         the head and `size` bytes of the body, then reset
  DRIP                   the response `size` bytes every `delay` seconds
  REPLACE                the backend executes; the client gets `data` instead (then closes
                         unless `keep_open`)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fault:
    kind: str
    size: int = 0
    delay: float = 0.0
    data: bytes = b""
    keep_open: bool = False


PASS = Fault("pass")
RESET_ON_ACCEPT = Fault("reset-on-accept")
RESET_BEFORE_RESPONSE = Fault("reset-before-response")


def reset_mid_body(after: int) -> Fault:
    return Fault("reset-mid-body", size=after)


def drip(size: int, delay: float) -> Fault:
    return Fault("drip", size=size, delay=delay)


def replace(data: bytes, *, keep_open: bool = False) -> Fault:
    return Fault("replace", data=data, keep_open=keep_open)


def trail(data: bytes, delay: float) -> Fault:
    """The backend's response, then `data` `delay` seconds later on the same connection: bytes
    an upstream sends after its answer (a forged second response, a late error page)."""
    return Fault("trail", data=data, delay=delay)


@dataclass
class Exchange:
    """One request the relay saw, and the response the backend gave it (None if not asked)."""

    request: bytes
    response: bytes | None = None


@dataclass
class FaultProxy:
    backend_port: int
    faults: deque[Fault] = field(default_factory=deque)
    exchanges: list[Exchange] = field(default_factory=list)
    connections: int = 0
    port: int = 0
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, *faults: Fault) -> None:
        """Faults for the next exchanges (or connections, for RESET_ON_ACCEPT), in order."""
        self.faults.extend(faults)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def refuse(self) -> None:
        """Stop listening: connecting to the port is refused (ECONNREFUSED)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def close(self) -> None:
        await self.refuse()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        backend: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            if self.faults and self.faults[0] is RESET_ON_ACCEPT:
                self.faults.popleft()
                reset(writer)
                return
            while request := await _read_message(reader):
                backend = backend or await asyncio.open_connection("127.0.0.1", self.backend_port)
                if not await self._exchange(request, backend, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if backend is not None:
                backend[1].close()
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _exchange(
        self,
        request: bytes,
        backend: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        client: asyncio.StreamWriter,
    ) -> bool:
        """Relay one exchange under the next fault; False once the client connection is done."""
        fault = self.faults.popleft() if self.faults else PASS
        exchange = Exchange(request)
        self.exchanges.append(exchange)
        backend[1].write(request)
        await backend[1].drain()
        response = await _read_message(backend[0], response=True)
        exchange.response = response
        if fault.kind == "reset-before-response":
            reset(client)
            return False
        if fault.kind == "reset-mid-body":
            head, _, body = response.partition(b"\r\n\r\n")
            client.write(head + b"\r\n\r\n" + body[: fault.size])
            await client.drain()
            reset(client)
            return False
        if fault.kind == "drip":
            for start in range(0, len(response), fault.size):
                client.write(response[start : start + fault.size])
                await client.drain()
                await asyncio.sleep(fault.delay)
            return True
        if fault.kind == "trail":
            client.write(response)
            await client.drain()
            await asyncio.sleep(fault.delay)
            client.write(fault.data)
            await client.drain()
            return True
        client.write(fault.data if fault.kind == "replace" else response)
        await client.drain()
        return fault.kind != "replace" or fault.keep_open


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0) rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _read_message(reader: asyncio.StreamReader, *, response: bool = False) -> bytes:
    """One HTTP/1.1 message framed by Content-Length (none: no body); b"" at a clean EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return b""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
        if name.strip().lower() == b"transfer-encoding":
            raise NotImplementedError("the fault proxy relays Content-Length bodies only")
    if response and head.split(b" ", 2)[1] in (b"204", b"304"):
        length = 0
    return head + await reader.readexactly(length)
