"""Real peers of the upstream leg for its tests: an HTTPS upstream with certificates made by
`trustme`, and an HTTP CONNECT proxy, both on loopback, both counting what reached them."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from pathlib import Path

import trustme
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy


class Upstream:
    """An aiohttp upstream, HTTPS when given a context; counts the requests its handler ran.
    It answers `status` after `delay` seconds."""

    def __init__(
        self, tls: ssl.SSLContext | None = None, *, status: int = 201, delay: float = 0
    ) -> None:
        self.tls = tls
        self.status = status
        self.delay = delay
        self.executed = 0
        self.headers: list[CIMultiDictProxy[str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.executed += 1
        self.headers.append(request.headers)
        await request.read()
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.json_response({"executed": self.executed}, status=self.status)

    async def __aenter__(self) -> Upstream:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.tls)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


class BlockingTlsUpstream:
    """An HTTPS upstream on a blocking socket in a thread, as OpenSSL-based servers (nginx)
    behave: a refused handshake is answered with its alert before the connection closes (the
    asyncio server closes without sending it, and the client then sees only a close after its
    request: an unknown outcome). Counts the requests it answered."""

    def __init__(self, tls: ssl.SSLContext) -> None:
        self.tls = tls
        self.executed = 0
        self.refusals: list[str] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> BlockingTlsUpstream:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._listener.close()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self._listener.accept()
                with connection:
                    self._answer(connection)

    def _answer(self, connection: socket.socket) -> None:
        tls = self.tls.wrap_socket(connection, server_side=True, do_handshake_on_connect=False)
        try:
            tls.do_handshake()
        except ssl.SSLError as exc:
            self.refusals.append(str(exc.reason))
            with socket.socket(fileno=tls.detach()) as raw:
                _linger(raw)
            return
        with tls, contextlib.suppress(OSError):
            head = b""
            while b"\r\n\r\n" not in head:
                head += tls.recv(65536)
            self.executed += 1
            tls.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def _linger(connection: socket.socket) -> None:
    """Lingering close, as nginx's: after the alert, read what the client sent until it closes;
    closed at once with bytes unread, the kernel resets the connection, and the reset may
    overtake the alert."""
    connection.settimeout(2)
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_WR)
        while connection.recv(65536):
            pass


class Certificates:
    """A CA for the upstream, one for clients, and their files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca = trustme.CA()
        self.client_ca = trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem.bytes())
        other = trustme.CA()
        self.other_ca_file = self._write("other-ca.pem", other.cert_pem.bytes())
        client = self.client_ca.issue_cert("proxy.test")
        self.client_cert_file = self._write("client.pem", client.cert_chain_pems[0].bytes())
        self.client_key_file = self._write("client.key", client.private_key_pem.bytes())

    def _write(self, name: str, content: bytes) -> Path:
        path = self.folder / name
        path.write_bytes(content)
        return path

    def server_context(self, *names: str, client_certificates: bool = False) -> ssl.SSLContext:
        """The upstream's context: a certificate for `names` (127.0.0.1 by default), and with
        `client_certificates` one required from every client, issued by `client_ca`."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert(*(names or ("127.0.0.1",))).configure_cert(context)
        if client_certificates:
            context.verify_mode = ssl.CERT_REQUIRED
            self.client_ca.configure_trust(context)
        return context


class ConnectProxy:
    """A forward proxy that only tunnels (HTTP CONNECT), as a corporate egress proxy does.

    `refuse` answers every CONNECT with that status line instead; `tunnels` counts the tunnels
    opened, `heads` keeps each CONNECT request's head."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.tunnels = 0
        self.heads: list[bytes] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def header(self, index: int, name: str) -> str | None:
        lines = self.heads[index].decode("latin-1").split("\r\n")[1:]
        fields = CIMultiDict[str](
            (name, value) for name, sep, value in (line.partition(": ") for line in lines) if sep
        )
        return fields.get(name)

    async def __aenter__(self) -> ConnectProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ")
            if method != "CONNECT" or self.refuse is not None:
                writer.write(f"HTTP/1.1 {self.refuse or '405 Method Not Allowed'}\r\n".encode())
                writer.write(b"Content-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                return
            host, _, port = target.rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            self._writers.add(up_writer)
            self.tunnels += 1
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
