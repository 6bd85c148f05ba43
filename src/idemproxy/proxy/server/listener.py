"""The client-facing listener of `idemproxy serve`: aiohttp's low-level server (`web.Server`)
calling the proxy's handler directly (`direct`: not through the app's router, which would
resolve the one catch-all route and build a match info for every request), with connections
served by `GuardedHandler` (the slow-client deadline, SPEC §9; quiet 400s, §8:
proxy/server/connection.py), accepted by the connection gate (proxy/server/gate.py), each
request's head written by `HeadWriter` (header values byte for byte, SPEC §7, §10; what the
app's prepare hooks do: proxy/server/head.py) and each whole response in one write
(proxy/server/whole.py). Public aiohttp API only, so that any aiohttp 3.x from the oldest
pyproject.toml admits serves it alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import HttpVersion11, StreamReader, hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage

from idemproxy.config.settings import LimitsSettings, ServerSettings, parse_listen
from idemproxy.http.as_sent import TARGET_AS_SENT
from idemproxy.http.host import asks_the_server, split_absolute_form
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.server.any_path import proxied
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


ProxyHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


@dataclass(frozen=True, slots=True)
class ProxyRoute:
    """The proxy's handler and its handler of `Expect`, as its one route in the app's router
    has them (proxy/app.py puts them in the app as it starts: `PROXY_ROUTE`)."""

    handler: ProxyHandler
    expect_handler: ExpectHandler


PROXY_ROUTE = web.AppKey("idemproxy.proxy_route", ProxyRoute)


def direct(route: ProxyRoute) -> RequestHandler:
    """The request handler of the listener: what the app's router would do for the proxy's one
    route (proxy/server/any_path.py; aiohttp's `Expect` handling, its 404 for a target that is
    not the proxy's), then `route`'s handler, whose response the connection writes (`respond`)
    before aiohttp's loop sees it: the end of every request, whatever answered it."""
    handler, expect_handler = route.handler, route.expect_handler

    async def respond(request: web.Request) -> web.StreamResponse:
        protocol = request.protocol
        assert isinstance(protocol, GuardedHandler)
        response: web.StreamResponse | None = None
        try:
            request = routable(request)
            # Origin-form, nearly every request's, tested in place (one call less).
            if not request.raw_path.startswith("/") and not proxied(request):
                response = await unroutable(request)
            else:
                if request.headers.get(hdrs.EXPECT):
                    response = await expected(expect_handler, request)
                if response is None:  # a response is a mapping: never tested for truth
                    response = await handler(request)
        except web.HTTPException as exc:  # aiohttp's exceptions are responses
            response = exc
        except Exception:
            protocol.served(request, 500)  # aiohttp answers 500 and closes the connection
            raise
        return await protocol.respond(request, response)

    # The listener's request factory makes `web.Request`s (`requests_with_head_writer`).
    return cast(RequestHandler, respond)


async def expected(
    expect_handler: ExpectHandler, request: web.Request
) -> web.StreamResponse | None:
    """RFC 9110 §10.1.1, as aiohttp's app does it: the handler of `Expect` either refuses the
    request (its response) or lets it go on (None), with any interim response sent."""
    response = await expect_handler(request)
    await request.writer.drain()
    return response


async def unroutable(request: web.Request) -> web.StreamResponse:
    """What aiohttp's router answers a target that is not the proxy's (an authority-form
    target): its default handling of `Expect`, then 404."""
    expect = request.headers.get(hdrs.EXPECT)
    if expect and request.version == HttpVersion11:
        if expect.lower() != "100-continue":
            return web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim response is not part of the body's size
        await request.writer.drain()
    return web.HTTPNotFound()


def routable(request: web.Request) -> web.Request:
    """RFC 9112 §3.2.1: an absolute-form target without a path (`GET http://host?q`) asks for
    `/`. aiohttp's router finds no resource for an empty path, so such a request is handled as
    the same target with its `/` (`http://host/?q`), as it was when the router routed it, and
    which is what the proxy forwards anyway (`/?q`, http/host.py). Any other request is handled
    as it came."""
    target = request.raw_path
    if target.startswith("/") or request.rel_url.path_safe:
        return request
    if asks_the_server(request.method, target):
        return request  # sent upstream as `*` (RFC 9112 §3.2.4), not as `/`
    absolute = split_absolute_form(target)
    if absolute is None:
        return request  # `OPTIONS *`, or an authority-form target: the router's 404
    scheme, authority, rest = absolute
    routed = request.clone(rel_url=f"{scheme}://{authority}{rest}")
    routed[TARGET_AS_SENT] = target  # the clone's is its URL's, without an empty query
    return routed


def requests_with_head_writer(loop: asyncio.AbstractEventLoop) -> RequestFactory:
    """The listener's request factory: a `web.Request` (what the app's factory makes, without
    its frame: the proxy reads no body through `client_max_size`, left at its default), with a
    writer that sends header values byte for byte and does what the app's prepare hooks do
    (proxy/server/head.py) in place of aiohttp's, not used yet; and it tells the connection
    that a request's head was read."""

    def make(
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        _writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        writer = HeadWriter(protocol, loop)
        if isinstance(protocol, GuardedHandler):
            protocol.request_started(payload, message)
            writer.connection = protocol
        return web.Request(message, payload, protocol, writer, task, loop)

    return make


def close_idle_connections(server: web.Server) -> None:
    """SPEC §8, a shutdown: idle kept-alive connections close now, busy ones after their
    response, which says `Connection: close`."""
    for connection in server.connections:
        if isinstance(connection, GuardedHandler):
            connection.close_when_idle()
        else:  # not this listener's (tests): aiohttp's own graceful close
            connection.close()


def requests_begun(server: web.Server | None) -> bool:
    """Whether a connection of `server` is reading or serving a request, or holds bytes of a
    next one: a head that began before a shutdown is still read and answered (SPEC §8)."""
    if server is None:
        return False
    for connection in server.connections:
        if isinstance(connection, GuardedHandler) and connection.begun():
            return True
    return False


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
        assert self.runner.server is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        server = web.Server(
            direct(self.runner.app[PROXY_ROUTE]),  # built as the app started
            request_factory=requests_with_head_writer(loop),
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

    async def accepted(self) -> None:
        """After `close`: until every connection accepted before it is set up and among the
        server's connections (a shutdown then sees each one, proxy/drain.py)."""
        if self.gate is not None:
            await self.gate.wait_closed()

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
