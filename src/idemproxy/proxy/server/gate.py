"""At most `limits.max_connections` client connections per process; the rest wait to be accepted.

asyncio's `create_server` accepts every connection the kernel offers, and has no way to pause.
This listener accepts with `loop.sock_accept` in a loop of its own (public asyncio API, uvloop
too) and stops accepting while the limit is reached: a new connection then waits, complete, in
the kernel's listen backlog (`server.backlog`) until one closes, and the client sees a slower
connect instead of a refusal; once the backlog is full too, the kernel answers further SYNs as
it does for any full listener (Linux drops them, so the client retries its SYN). Nothing is
written on a connection the proxy did not accept, so no client ever reads a partial answer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)
# After accept() failed (EMFILE: out of file descriptors), before the next try.
_ACCEPT_RETRY_SECONDS = 0.1

Closed = Callable[[], None]
ProtocolFactory = Callable[[Closed], asyncio.Protocol]


class ConnectionGate(asyncio.AbstractServer):
    """Accepts on `sockets` while fewer than `limit` connections are open; `factory(closed)`
    builds each connection's protocol, which calls `closed()` once when its connection ends."""

    def __init__(self, sockets: list[socket.socket], factory: ProtocolFactory, limit: int) -> None:
        self._sockets = sockets
        self._factory = factory
        self.limit = limit
        self.open = 0
        self._room = asyncio.Event()
        self._room.set()
        self._closing = False
        # Accept tasks setting a connection up: `close` lets them finish (see there).
        self._setting_up: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept_forever(sock)) for sock in sockets]

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._sockets)

    def close(self) -> None:
        """Accept no more. A connection accepted already and being set up is not cut off: a
        transport cancelled half-way is closed by the loop after its protocol may have read
        and started a request (the upstream then runs it and its answer has nowhere to go).
        It finishes, joins the server's connections, and the shutdown treats it as any other
        (proxy/drain.py): `wait_closed` waits for it."""
        self._closing = True
        for task in self._tasks:
            if task not in self._setting_up:
                task.cancel()
        for sock in self._sockets:
            sock.close()

    async def wait_closed(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def is_serving(self) -> bool:
        return any(not task.done() for task in self._tasks)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    async def start_serving(self) -> None:
        return None  # accepting since construction

    async def serve_forever(self) -> None:
        await self.wait_closed()

    async def _accept_forever(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._room.wait()
            try:
                conn, _peer = await loop.sock_accept(sock)
            except OSError as exc:
                log.warning("accepting a client connection failed: %s", exc)
                await asyncio.sleep(_ACCEPT_RETRY_SECONDS)
                continue
            try:
                while self.open >= self.limit:  # another listening socket took the last place
                    await self._room.wait()
            except asyncio.CancelledError:
                conn.close()  # closed: never read, so nothing of it ran
                raise
            self._opened()
            task = asyncio.current_task()
            assert task is not None
            self._setting_up.add(task)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.connect_accepted_socket(lambda: self._factory(self._once()), conn)
            except OSError as exc:
                log.info("a client connection was lost while being set up: %s", exc)
                conn.close()
                self._closed()
            finally:
                self._setting_up.discard(task)
            if self._closing:
                return

    def _once(self) -> Closed:
        done = False

        def closed() -> None:
            nonlocal done
            if not done:
                done = True
                self._closed()

        return closed

    def _opened(self) -> None:
        self.open += 1
        if self.open >= self.limit:
            self._room.clear()

    def _closed(self) -> None:
        self.open -= 1
        if self.open < self.limit:
            self._room.set()


def listening_sockets(
    host: str, port: int, *, backlog: int, reuse_port: bool
) -> Iterable[socket.socket]:
    """Bound, listening, non-blocking sockets for `host:port`, as `loop.create_server` makes
    them: one per address `host` resolves to, IPv6 ones IPv6-only."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    made: list[socket.socket] = []
    try:
        for family, kind, proto, _name, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            made.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in made:
            sock.close()
        raise
    return made
