"""The client-facing listener: the slow-client deadline aiohttp lacks (SPEC §9), quiet 400s (§8).

aiohttp reads a request head without a deadline of its own. Before 3.14 a connection that
trickles header bytes (slowloris) is never cut off; since then only by `keepalive_timeout`, which
behind a load balancer must outlast the balancer's idle timeout (60 s on AWS ALB). Each
connection here is served by `GuardedHandler` instead: a new connection must deliver its first
request head within `server.header_read_timeout`, and on a kept-alive connection the next head
must arrive in full within that time of its first byte. Idle time between requests stays
`keepalive_timeout`'s business. A head that is too slow gets 408 and the connection is closed;
nothing of it reached the handler, so no job exists and nothing went upstream.

The request handler tells its connection when a head was read (`head_read`): from then on only
the body deadline (`server.body_read_timeout`) and the upstream timeout apply, until the
response has been written. Private aiohttp surface used here: `RequestHandler.finish_response`,
`RequestHandler._upgraded`, `RequestHandler._messages` (a shutdown's idleness test) and
`Server._kwargs` (tests/hostile pin them), that of proxy/server/whole.py, proxy/server/head.py and
proxy/server/any_path.py, `RequestHandler._request_handler` (were it renamed, requests would go
through the app's router again: slower, not wrong), and `RequestHandler._request_factory`, through
which each request gets the writer of proxy/server/head.py (tests/proxy/test_header_bytes.py pins
it: without it obs-text is lost again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiohttp import HttpVersion11, StreamReader, hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage

from idemproxy.config.settings import LimitsSettings, ServerSettings, parse_listen
from idemproxy.constants import ERROR_HEADER, PROBLEM_CONTENT_TYPE
from idemproxy.errors import RequestTimeout
from idemproxy.http.deadline import Deadline
from idemproxy.http.problems import problem_response
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.server.any_path import RequestHandler, direct_handler
from idemproxy.proxy.server.gate import ConnectionGate, listening_sockets
from idemproxy.proxy.server.head import HeadWriter
from idemproxy.proxy.server.whole import NotifiedResponse, WholeResponse, mark_sent, serialise_whole

log = logging.getLogger(__name__)


class GuardedHandler(web.RequestHandler):
    """aiohttp's connection handler plus a header-read deadline and 4xx pages that echo nothing."""

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        header_timeout: float,
        server_token: str,
        request_handler: RequestHandler | None = None,
        on_closed: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._on_closed = on_closed  # the connection gate's count (proxy/server/gate.py)
        if request_handler is not None:  # instead of the app's router (any_path.direct_handler)
            self._request_handler = request_handler  # type: ignore[assignment]
        self._make_request = self._request_factory
        self._request_factory = self._with_head_writer
        self._header_timeout = header_timeout
        self._server_token = server_token  # the Server field of the proxy's own answers
        self._head_deadline = Deadline(loop, self._head_timed_out)  # one timer (deadline.py)
        self._serving = False  # the head of the current request was read; its handler runs
        self._head_started = False  # bytes of the next head arrived since the last response
        self._unread: StreamReader | None = None  # a body aiohttp drains after the response
        self._closing = False  # a shutdown began: the next response closes the connection

    def _with_head_writer(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        _writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        """The request aiohttp makes (the app's request factory), with a writer that sends
        header values byte for byte (proxy/server/head.py) in place of aiohttp's, not used yet."""
        assert self._make_request is not None
        writer = HeadWriter(protocol, self._loop)
        return self._make_request(message, payload, protocol, writer, task)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()  # a new connection owes its first head within the deadline

    def data_received(self, data: bytes) -> None:
        if data and not self._serving and not self._draining():
            self._head_started = True
            if not self._head_deadline.running:
                self._arm()  # the first byte of the next head on a kept-alive connection
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._head_deadline.close()
        if self._on_closed is not None:
            self._on_closed()
        super().connection_lost(exc)

    def close_when_idle(self) -> None:
        """A shutdown began (proxy/drain.py): close now if idle, else after the next response.

        Not aiohttp's `close()` on a busy connection: from then on it drops every byte that
        arrives, the rest of a request body too, and the request would hang on it."""
        self._closing = True
        queued = getattr(self, "_messages", ())  # parsed requests not yet handled (pipelined)
        idle = not (self._serving or self._head_started or queued or self._draining())
        if idle:
            self.close()

    @property
    def closing(self) -> bool:
        """A shutdown began: the connection closes after the response being handled."""
        return self._closing

    def head_read(self) -> None:
        """The request's head arrived and its handler runs: no deadline until the response."""
        self._serving = True
        self._disarm()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        # Every response ends here, also those answered before the handler ran (417).
        if self._closing:
            # A shutdown closes this connection after the response (proxy/drain.py): say so,
            # so that the client sends its next request elsewhere (RFC 9112 §9.6).
            resp.force_close()
        try:
            whole = (
                None
                if self._upgraded
                else serialise_whole(request, resp, server_token=self._server_token)
            )
            if whole is None:
                return await super().finish_response(request, resp, start_time)
            return await self._write_whole(request, resp, start_time, whole)
        finally:
            self._served(request, resp.status)

    async def _write_whole(
        self,
        request: web.BaseRequest,
        resp: web.StreamResponse,
        start_time: float | None,
        whole: WholeResponse,
    ) -> tuple[web.StreamResponse, bool]:
        """What aiohttp's `finish_response` does for a complete response, in one write
        (proxy/server/whole.py). The request's multipart temporaries (`request._finish`) do not
        exist: this proxy never parses form data."""
        mark_sent(resp, whole.keep_alive)
        transport = self.transport
        if transport is None or transport.is_closing():
            _written(resp)
            self.log_access(request, resp, start_time)
            return resp, True  # the client is gone: aiohttp stops serving the connection
        transport.write(whole.data)
        writer = request.writer
        writer.output_size += len(whole.data)
        if whole.body:
            return await self._write_large(request, resp, start_time, whole)
        await writer.drain()  # waits only while the transport has paused writing
        self.log_access(request, resp, start_time)
        return resp, False

    async def _write_large(
        self,
        request: web.BaseRequest,
        resp: web.StreamResponse,
        start_time: float | None,
        whole: WholeResponse,
    ) -> tuple[web.StreamResponse, bool]:
        """A large body after its head, in pieces: the transport keeps at most about its
        high-water mark beyond what the client took, rather than a copy of the whole body."""
        transport, writer = self.transport, request.writer
        writer.output_size += len(whole.body)
        gone = False
        try:
            for piece in whole.pieces():
                await writer.drain()
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("the client is gone")
                transport.write(piece)
            await writer.drain()
        except ConnectionError:
            gone = True
        finally:
            _written(resp)
        self.log_access(request, resp, start_time)
        return resp, gone

    def _served(self, request: web.BaseRequest, status: int) -> None:
        """The response is out: the next byte starts a new head (unless it is unread body)."""
        self._serving = self._head_started = False
        self._disarm()
        body = request.content
        self._unread = None if body.is_eof() else body
        if status == 408 and self._unread is not None:
            # Too slow to send its body: it will not finish while aiohttp lingers over it
            # (up to 10 s more). Close now.
            self.force_close()
        elif request.version < HttpVersion11 and hdrs.TRANSFER_ENCODING in request.headers:
            # RFC 9112 §6.1: HTTP/1.0 with Transfer-Encoding has faulty framing: close after it
            # (aiohttp kept such a connection alive for the next request).
            self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        # SPEC §8: never echo raw attacker bytes. aiohttp's own page quotes the offending line,
        # and logs a traceback per malformed request (a cheap way to flood the logs).
        log.info("malformed request from %s refused with %d", request.remote, status)
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; no room for the 4xx")
        response = web.Response(status=status, text=f"{status} {_phrase(status)}\n")
        response.force_close()
        return response

    def _draining(self) -> bool:
        """Whether bytes are the rest of an unread body (aiohttp's lingering_time bounds it)."""
        if self._unread is not None and not self._unread.is_eof():
            return True
        self._unread = None
        return False

    def _arm(self) -> None:
        self._head_deadline.start(self._header_timeout)

    def _disarm(self) -> None:
        self._head_deadline.stop()

    def _head_timed_out(self) -> None:
        transport = self.transport
        if self._serving or transport is None or transport.is_closing():
            return
        if self._head_started:  # RFC 9110 §15.5.9; a connection that sent nothing just closes
            transport.write(_REQUEST_TIMEOUT)
        self.force_close()


def _written(resp: web.StreamResponse) -> None:
    if type(resp) is NotifiedResponse:
        resp.written()


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Client Error"


def _request_timeout_bytes() -> bytes:
    """A complete 408 problem response (SPEC §8), written straight to the socket."""
    error = RequestTimeout("The request head did not arrive in time.")
    body = problem_response(error).body
    assert isinstance(body, bytes)
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        f"Content-Type: {PROBLEM_CONTENT_TYPE}\r\n"
        f"{ERROR_HEADER}: {error.code}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


_REQUEST_TIMEOUT = _request_timeout_bytes()


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

    SPEC §8. `finish_response` does this for a response that is not prepared yet; a streamed
    one (governed or pass-through) is prepared inside its handler, and aiohttp has already
    decided its Connection header when this signal runs (after `_prepare_headers`, before the
    head is serialised), so the header is set here as well as the persistence."""
    protocol = request.protocol
    if isinstance(protocol, GuardedHandler) and protocol.closing:
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"


def head_read(request: web.BaseRequest) -> None:
    """Stop the header-read deadline of the request's connection (a no-op on other listeners)."""
    protocol = request.protocol
    if isinstance(protocol, GuardedHandler):
        protocol.head_read()


class GuardedSite(web.BaseSite):
    """A TCP listener like `web.TCPSite` whose connections are served by `GuardedHandler`,
    at most `limits.max_connections` at a time (counted in `metrics.client_connections`)."""

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
        super().__init__(runner)
        self._host, self._port = parse_listen(listen)
        self._settings = settings
        self._limits = limits
        self._metrics = metrics
        self._app_runner = runner
        # SO_REUSEPORT (set before bind by the event loop): the workers of one supervisor each
        # bind `listen`, and the kernel spreads new connections over them.
        self._reuse_port = reuse_port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._app_runner.server
        assert server is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        # What aiohttp itself would pass to each connection's handler (the runner's keyword
        # arguments and the app's handler_args), plus the deadline and the header-count bound.
        kwargs = {**server._kwargs, "max_headers": self._settings.max_headers}
        header_timeout = self._settings.header_read_timeout
        server_token = self._settings.server_token
        app = self._app_runner.app
        handler = direct_handler(app)
        limits = self._limits

        def protocol(closed: Callable[[], None]) -> GuardedHandler:
            return GuardedHandler(
                server,
                loop=loop,
                header_timeout=header_timeout,
                server_token=server_token,
                request_handler=handler,
                on_closed=closed,
                **kwargs,
            )

        sockets = listening_sockets(
            self._host, self._port, backlog=limits.backlog, reuse_port=self._reuse_port
        )
        gate = ConnectionGate(list(sockets), protocol, limits.max_connections)
        self._metrics.client_connections.set_function(lambda: gate.open)
        self._server = gate
