"""The request handler: route, identify (before any storage call), then govern or pass through."""

from __future__ import annotations

from aiohttp import web

from idemproxy.errors import KeyMissing, NoRoute, ProblemError
from idemproxy.fingerprint import fingerprint, fingerprint_of_digest
from idemproxy.key import parse_key
from idemproxy.owner import derive_owner
from idemproxy.proxy.body import RequestBody, read_body
from idemproxy.proxy.context import CONTEXT, ProxyContext
from idemproxy.proxy.governed import handle_governed
from idemproxy.proxy.listener import head_read
from idemproxy.proxy.passthrough import passthrough
from idemproxy.proxy.problems import problem_response
from idemproxy.proxy.trace import Trace, record
from idemproxy.types import Intent


async def handle(request: web.Request) -> web.StreamResponse:
    head_read(request)  # SPEC §9: the header-read deadline is over for this request
    ctx = request.app[CONTEXT]
    trace = Trace()
    ctx.requests_in_flight += 1
    try:
        response = await _route(ctx, request, trace)
    finally:
        ctx.requests_in_flight -= 1
    record(ctx.metrics, trace, response.status, log_requests=ctx.settings.log_requests)
    return response


async def _route(ctx: ProxyContext, request: web.Request, trace: Trace) -> web.StreamResponse:
    try:
        route = ctx.routes.find(request.path, request.host)
        if route is None:
            raise NoRoute()
        if request.method not in ctx.governed_methods:
            return await passthrough(ctx, request, route)  # SPEC §4: keys here are ignored
        key = parse_key(request.headers.getall(ctx.settings.key_header, []))
        if key is None:
            if route.require_key:
                raise KeyMissing()
            return await passthrough(ctx, request, route)
        intent, body = await _identify(ctx, request, key)
        trace.owner = intent.owner
        return await handle_governed(ctx, request, route, intent, body, trace)
    except ProblemError as error:
        trace.problem(error)
        return problem_response(error, profile=ctx.settings.profile)


async def _identify(
    ctx: ProxyContext, request: web.Request, key: str
) -> tuple[Intent, RequestBody]:
    """SPEC §2.1: key, owner, bounded body and fingerprint, all before any storage call."""
    owner = derive_owner(ctx.owner, request.headers)
    body = await read_body(
        request,
        limit=ctx.settings.max_request_body,
        timeout=ctx.settings.server.body_read_timeout,
        spool_threshold=ctx.settings.server.spool_threshold,
    )
    url = request.rel_url
    content_type = request.headers.get("Content-Type")
    if body.spooled:  # hashed as it arrived; too large to canonicalise (proxy/body.py)
        digest = fingerprint_of_digest(
            request.method, url.raw_path, url.raw_query_string, content_type, body.raw_sha256
        )
    else:
        digest = fingerprint(
            request.method,
            url.raw_path,
            url.raw_query_string,
            content_type,
            body.memory,
            ctx.settings.fingerprint_exclude,
        )
    intent = Intent(
        owner=owner, key=key, fingerprint=digest, method=request.method, path=url.raw_path
    )
    return intent, body
