"""The client-facing listener of `idemproxy serve`: aiohttp's low-level server (`web.Server`)
over the app's request handler, with connections served by `GuardedHandler` (the slow-client
deadline, SPEC §9; quiet 400s, §8: proxy/server/connection.py), accepted by the connection gate
(proxy/server/gate.py), each request's head written by `HeadWriter` (header values byte for
byte, SPEC §7, §10: proxy/server/head.py) and each whole response in one write
(proxy/server/whole.py). Public aiohttp API only, so that any aiohttp 3.x from the oldest
pyproject.toml admits serves it alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import StreamReader, hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage

from idemproxy.config.settings import LimitsSettings, ServerSettings, parse_listen
from idemproxy.http.host import split_absolute_form
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.server.connection import GuardedHandler
from idemproxy.proxy.server.gate import ConnectionGate, listening_sockets
from idemproxy.proxy.server.head import HeadWriter

RequestHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
RequestFactory = Callable[
    [
        RawRequestMessage,
        StreamReader,
        web.RequestHandler,
        AbstractStreamWriter,
        "asyncio.Task[None]",
    ],
    web.BaseRequest,
]


def handler_options(settings: ServerSettings) -> dict[str, Any]:
    """The keyword arguments of each connection's handler: `idemproxy serve`'s limits."""
    return {
        "keepalive_timeout": settings.keepalive_timeout,
        "max_line_size": settings.max_line_size,
        "max_field_size": settings.max_field_size,
        "max_headers": settings.max_headers,
        # RFC 9110 §8.4: a content coding is the client's and the backend's business. With
        # aiohttp's default a gzip body was decompressed here and went on still labelled
        # gzip (tests/proxy/test_content_coding.py).
        "auto_decompress": False,
        "access_log": None,  # one log line per request costs more than the proxy itself
    }


def guarded(handle: RequestHandler) -> RequestHandler:
    """The app's request handler, whose response the connection writes (`respond`) before
    aiohttp's loop sees it: the end of every request, whatever answered it."""

    async def respond(request: web.BaseRequest) -> web.StreamResponse:
        protocol = request.protocol
        assert isinstance(protocol, GuardedHandler)
        try:
            response = await handle(routable(request))
        except web.HTTPException as exc:  # aiohttp's exceptions are responses (the router's 404)
            response = exc
        except Exception:
            protocol.served(request, 500)  # aiohttp answers 500 and closes the connection
            raise
        return await protocol.respond(request, response)

    return respond


def routable(request: web.BaseRequest) -> web.BaseRequest:
    """RFC 9112 §3.2.1: an absolute-form target without a path (`GET http://host?q`) asks for
    `/`. aiohttp's router finds no resource for an empty path, so such a request is routed as
    the same target with its `/` (`http://host/?q`), which is what the proxy forwards anyway
    (`/?q`, http/host.py). Any other request is routed as it came."""
    target = request.raw_path
    if target.startswith("/") or request.rel_url.path_safe:
        return request
    absolute = split_absolute_form(target)
    if absolute is None:
        return request  # `*` or an authority-form target: the router's 404
    scheme, authority, rest = absolute
    return request.clone(rel_url=f"{scheme}://{authority}{rest}")


def with_head_writer(
    make_request: RequestFactory, loop: asyncio.AbstractEventLoop
) -> RequestFactory:
    """The app's request factory, handing each request a writer that sends header values byte
    for byte (proxy/server/head.py) in place of aiohttp's, not used yet, and telling the
    connection that a request's head was read."""

    def make(
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        _writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        if isinstance(protocol, GuardedHandler):
            protocol.request_started(payload)
        return make_request(message, payload, protocol, HeadWriter(protocol, loop), task)

    return make


def close_idle_connections(server: web.Server) -> None:
    """SPEC §8, a shutdown: idle kept-alive connections close now, busy ones after their
    response, which says `Connection: close`."""
    for connection in server.connections:
        if isinstance(connection, GuardedHandler):
            connection.close_when_idle()
        else:  # not this listener's (tests): aiohttp's own graceful close
            connection.close()


async def close_when_closing(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: a head written after a shutdown began says `Connection: close`.

    SPEC §8. `respond` does this for a response that is not prepared yet; a streamed one
    (governed or pass-through) is prepared inside its handler, and aiohttp has already decided
    its Connection header when this signal runs (after it prepared the headers, before it
    serialises them), so the header is set here as well as the persistence."""
    protocol = request.protocol
    if isinstance(protocol, GuardedHandler) and protocol.closing:
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"


def head_read(request: web.BaseRequest) -> None:
    """Stop the header-read deadline of the request's connection (a no-op on other listeners)."""
    protocol = request.protocol
    if isinstance(protocol, GuardedHandler):
        protocol.head_read()


class GuardedSite:
    """A TCP listener for `runner`'s app, like `web.TCPSite`, whose connections are served by
    `GuardedHandler`, at most `limits.max_connections` at a time (counted in
    `metrics.client_connections`). Not one of `runner.sites`: `close` stops accepting,
    `stop` also closes its connections, before `runner.cleanup()`."""

    def __init__(
        self,
        runner: web.AppRunner,
        listen: str,
        settings: ServerSettings,
        limits: LimitsSettings,
        metrics: Metrics,
        *,
        reuse_port: bool = False,
    ) -> None:
        self.host, self.port = parse_listen(listen)
        self.runner = runner
        self.settings = settings
        self.limits = limits
        self.metrics = metrics
        # SO_REUSEPORT (set before bind by the event loop): the workers of one supervisor each
        # bind `listen`, and the kernel spreads new connections over them.
        self.reuse_port = reuse_port
        self.server: web.Server | None = None
        self.gate: ConnectionGate | None = None

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def addresses(self) -> list[Any]:
        """The bound addresses (`getsockname()`), as `runner.addresses` lists a TCPSite's."""
        return [] if self.gate is None else [sock.getsockname() for sock in self.gate.sockets]

    async def start(self) -> None:
        app_server = self.runner.server
        assert app_server is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        server = web.Server(
            guarded(app_server.request_handler),
            request_factory=with_head_writer(app_server.request_factory, loop),
            handler_cancellation=False,  # SPEC §2: a client hanging up cancels nothing
        )
        options = handler_options(self.settings)
        header_timeout = self.settings.header_read_timeout
        server_token = self.settings.server_token

        def protocol(closed: Callable[[], None]) -> GuardedHandler:
            return GuardedHandler(
                server,
                loop=loop,
                header_timeout=header_timeout,
                server_token=server_token,
                on_closed=closed,
                **options,
            )

        sockets = listening_sockets(
            self.host, self.port, backlog=self.limits.backlog, reuse_port=self.reuse_port
        )
        gate = ConnectionGate(list(sockets), protocol, self.limits.max_connections)
        self.metrics.client_connections.set_function(lambda: gate.open)
        self.server, self.gate = server, gate

    def close(self) -> None:
        """Accept no more connections; those open go on."""
        if self.gate is not None:
            self.gate.close()

    async def stop(self, shutdown_timeout: float = 1.0) -> None:
        """Accept no more connections, close idle ones, and give busy ones `shutdown_timeout`
        to finish their response before they are closed."""
        self.close()
        if self.gate is not None:
            await self.gate.wait_closed()
        server, self.server = self.server, None
        if server is not None:
            close_idle_connections(server)
            await server.shutdown(shutdown_timeout)
