"""Proxying requests that are not governed: streamed both ways, no storage call (SPEC §2.5)."""

from __future__ import annotations

import logging

from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from idemproxy.decision import Failure
from idemproxy.errors import UpstreamTimeout, UpstreamUnavailable
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.forward import UpstreamClient, UpstreamFailure
from idemproxy.proxy.headers import request_headers_for_upstream, response_headers_for_client
from idemproxy.proxy.problems import problem_response
from idemproxy.proxy.routing import Route

log = logging.getLogger(__name__)


def upstream_url(route: Route, request: web.Request) -> URL:
    # raw_path keeps the client's exact path and query bytes, no re-quoting. Callers must pass
    # this URL object on as it is: str() of it is re-parsed and re-quoted by aiohttp (%2F -> /).
    return URL(route.upstream + request.raw_path, encoded=True)


def forwarded_headers(request: web.Request) -> CIMultiDict[str]:
    return request_headers_for_upstream(
        request.headers, client_ip=request.remote, scheme=request.scheme, host=request.host
    )


async def passthrough(
    ctx: ProxyContext, request: web.Request, route: Route, body: bytes | None = None
) -> web.StreamResponse:
    data = (
        body if body is not None else (request.content.iter_any() if request.body_exists else None)
    )
    response = web.StreamResponse()
    try:
        async with ctx.upstream.request(
            request.method,
            upstream_url(route, request),
            forwarded_headers(request),
            data,
            content_length=request.content_length,
        ) as upstream:
            response.set_status(upstream.status, upstream.reason)
            response.headers.extend(response_headers_for_client(upstream.headers))
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in UpstreamClient.iter_body(upstream):
                await response.write(chunk)
            await response.write_eof()
            return response
    except UpstreamFailure as failure:
        if response.prepared:
            log.warning("pass-through cut off mid-response: %s", failure.reason)
            raise ConnectionResetError(failure.reason) from failure
        problem = UpstreamTimeout if failure.failure is Failure.TIMEOUT else UpstreamUnavailable
        return problem_response(problem(), profile=ctx.settings.profile)
