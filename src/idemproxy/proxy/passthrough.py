"""Proxying requests that are not governed: streamed both ways, no storage call (SPEC §2.5)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict
from yarl import URL

from idemproxy.config.settings import Settings
from idemproxy.core.machine import Outcome, classify_failure
from idemproxy.errors import NEVER, BodyInvalid, ClientDisconnected, ProblemError
from idemproxy.http.headers import asks_the_server, drop_for_client, outgoing
from idemproxy.http.problems import problem_response
from idemproxy.observe.metrics import DisconnectStage, Metrics
from idemproxy.proxy.reasons import upstream_reason
from idemproxy.proxy.routing import Route, upstream_origin
from idemproxy.proxy.server.connection import (
    AsSentResponse,
    AsSentStreamResponse,
    RequestBody,
    read_body,
)
from idemproxy.proxy.server.hangups import client_gone
from idemproxy.proxy.server.sink import abort
from idemproxy.proxy.server.trace import Trace
from idemproxy.proxy.upstream.client import UpstreamClient, UpstreamFailure, UpstreamResponse

if TYPE_CHECKING:
    from idemproxy.proxy.tracing import Tracing

log = logging.getLogger(__name__)
# Request bodies up to this size with a declared length are read whole rather than streamed;
# responses up to it that arrived whole with their head go out in one write.
SMALL_BODY = 64 * 1024


@dataclass(frozen=True, slots=True)
class PassThrough:
    """Forwards requests untracked, with the collaborators of one process, given when built."""

    settings: Settings
    upstream: UpstreamClient
    metrics: Metrics
    tracing: Tracing | None

    async def forward(
        self,
        request: web.Request,
        route: Route,
        body: RequestBody | None = None,
        *,
        trace: Trace,
    ) -> web.StreamResponse:
        """Forward untracked. Small bodies of known length go in one write each way; anything
        else streams, so memory stays bounded whatever the size."""
        if body is None and _small(request.content_length):
            body = await read_body(
                request,
                limit=SMALL_BODY,
                timeout=self.settings.server.body_read_timeout,
                spool_threshold=SMALL_BODY,
            )  # SPEC §9: a drip-fed body gets 408, not a handler held for ever
        data: bytes | AsyncIterable[bytes] | None
        length: int | None
        if body is not None:
            data = body.memory if body.memory is not None else body.reader()
            length = body.size
        else:
            data = request.content.iter_any() if request.body_exists else None
            length = request.content_length
        edits = route.header_edits.get(route.upstream, ())
        trusted = self.settings.trusted_proxies
        url, headers = outgoing(request, route.upstream, route.forward_host, edits, trusted)
        forwarding = self._exchange(request, route, trace, _Outgoing(url, headers, data, length))
        if self.tracing is not None:  # its traceparent joins `headers` before they are sent
            return await self.tracing.forward(request.method, url, headers, forwarding)
        return await forwarding

    async def _exchange(
        self, request: web.Request, route: Route, trace: Trace, outgoing: _Outgoing
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None  # only a streamed answer needs one
        try:
            async with self.upstream.request(
                request.method,
                outgoing.url,
                outgoing.headers,
                outgoing.data,
                content_length=outgoing.length,
                timeout=route.upstream_timeout,
                target=None if request.raw_path[0] == "/" else _asterisk(request),
            ) as upstream:
                # Only a body that arrived whole with its head goes out in one write; one still
                # on its way streams, so the client gets the head and what came at once, as it
                # would from the upstream directly. A HEAD response declares the length of a
                # body it does not carry: stream it.
                if (
                    upstream.complete
                    and _small(upstream.content_length)
                    and request.method != "HEAD"
                ):
                    content, _ = await UpstreamClient.read_body(upstream, SMALL_BODY)
                    return _buffered(upstream, content)
                response = AsSentStreamResponse()
                await self._stream(request, response, upstream)
                return response
        except UpstreamFailure as failure:
            broken = failure.client_body
            if broken is not None and response is None:  # the client's side broke, not the upstream
                if isinstance(broken, HttpProcessingError | web.RequestPayloadError):
                    return self._body_invalid()
                if isinstance(broken, ConnectionError):
                    raise ClientDisconnected() from broken  # it hung up mid-upload: a 499
            reason = upstream_reason(failure)
            trace.failed(route.upstream, reason)
            if self.tracing is not None:
                self.tracing.upstream_failed(failure.reason)
            if response is not None and response.prepared:
                # Not raised: aiohttp would log a traceback at ERROR for every upstream that
                # cuts off.
                log.warning(
                    "pass-through from %s cut off mid-response (%s): %s",
                    upstream_origin(route.upstream),
                    reason,
                    failure.reason,
                )
                abort(request, response)
                return response
            log.warning(
                "pass-through to %s failed (%s): %s",
                upstream_origin(route.upstream),
                reason,
                failure.reason,
            )
            outcome, problem = classify_failure(failure.failure)  # a governed request's answer
            error = problem()
            if outcome is not Outcome.RELEASE:  # SPEC §8: no job, and it may have executed
                error.retry = NEVER
            return self._problem(error)

    async def _stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        upstream: UpstreamResponse,
    ) -> None:
        response.set_status(upstream.status, upstream.reason)
        response.headers.extend(upstream.headers)  # a fresh response: no fields of its own yet
        drop_for_client(response.headers)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        try:
            await response.prepare(request)
            async for chunk in UpstreamClient.iter_body(upstream):
                await response.write(chunk)
            await response.write_eof()
        except ConnectionError:
            # Only the client's side raises it here (the upstream's failures are UpstreamFailure);
            # leaving the exchange unread closes the upstream connection rather than pooling it.
            client_gone(self.metrics, request, DisconnectStage.RESPONSE)

    def _body_invalid(self) -> web.StreamResponse:
        """The client's chunked body broke its framing while it streamed upstream (SPEC §8): its
        error, not the upstream's. The upstream got no whole request (its connection was cut before
        the body's end); where the client's next request would begin is unknown, so the connection
        closes after the answer."""
        # Not the parser's message: it quotes the client's bytes, line breaks and all.
        log.info("pass-through request refused: its chunked body's framing is invalid")
        problem = BodyInvalid()
        response = self._problem(problem)
        response.force_close()
        return response

    def _problem(self, error: ProblemError) -> web.StreamResponse:
        return problem_response(
            error, profile=self.settings.profile, types=self.settings.problem_types
        )


@dataclass(slots=True)
class _Outgoing:
    """What goes upstream: where, with which headers (a traceparent may still join them) and
    which body."""

    url: URL
    headers: CIMultiDict[str]
    data: bytes | AsyncIterable[bytes] | None
    length: int | None


def _asterisk(request: web.Request) -> str | None:
    """`*` for a question to the upstream as a whole (RFC 9112 §3.2.4), which no URL holds;
    None for any other request (the URL's path and query)."""
    return "*" if asks_the_server(request.method, request.raw_path) else None


def _small(length: int | None) -> bool:
    return length is not None and length <= SMALL_BODY


def _buffered(upstream: UpstreamResponse, content: bytes) -> web.Response:
    response = AsSentResponse(
        status=upstream.status, reason=upstream.reason, body=content, headers=upstream.headers
    )
    drop_for_client(response.headers)
    return response
