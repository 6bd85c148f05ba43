"""The request handler: route, identify (before any storage call), then govern or pass through."""

from __future__ import annotations

from aiohttp import HttpVersion11, hdrs, web

from idemproxy.core.types import Intent
from idemproxy.errors import (
    BodyTooLarge,
    ClientDisconnected,
    HeaderInvalid,
    KeyMissing,
    NoRoute,
    ProblemError,
)
from idemproxy.http.headers import hop_by_hop
from idemproxy.http.problems import problem_response
from idemproxy.identity.fingerprint import FingerprintedHead, fingerprint, fingerprint_of_digest
from idemproxy.identity.key import parse_key
from idemproxy.identity.owner import derive_owner
from idemproxy.metrics import DisconnectStage
from idemproxy.proxy.context import CONTEXT, ProxyContext
from idemproxy.proxy.jobs.governed import handle_governed
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.passthrough import passthrough
from idemproxy.proxy.routing import routable_path
from idemproxy.proxy.server.body import RequestBody, read_body
from idemproxy.proxy.server.hangups import client_gone
from idemproxy.proxy.server.host import valid_host
from idemproxy.proxy.server.listener import head_read
from idemproxy.proxy.server.one_response import only_response
from idemproxy.proxy.server.trace import Trace, record
from idemproxy.proxy.upstream.h1 import transfer_codings


async def handle(request: web.Request) -> web.StreamResponse:
    head_read(request)  # SPEC §9: the header-read deadline is over for this request
    ctx = request.app[CONTEXT]
    trace = Trace(request=request)
    ctx.requests_in_flight += 1
    try:
        routing = _route(ctx, request, trace)
        if ctx.tracing is not None:
            routing = ctx.tracing.serve(request, trace, routing)
        response = await routing
    finally:
        ctx.requests_in_flight -= 1
    response = only_response(ctx.metrics, request, response)
    settings = ctx.settings
    record(
        ctx.metrics,
        trace,
        response.status,
        log_requests=settings.log_requests,
        access_log=settings.access_log,
        log_query=settings.log_query,
    )
    return response


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """RFC 9110 §10.1.1: refuse an over-size governed body before inviting it (SPEC §9: 413);
    otherwise answer as aiohttp's default handler does."""
    if request.version != HttpVersion11:
        return None
    if request.headers.get("Expect", "").lower() != "100-continue":
        return web.Response(status=417, text="Unknown Expect")
    ctx = request.app[CONTEXT]
    declared = request.content_length
    if (
        request.method in ctx.governed_methods
        and ctx.settings.key_header in request.headers
        and declared is not None
        and declared > ctx.settings.max_request_body
    ):
        return problem_response(
            BodyTooLarge(), profile=ctx.settings.profile, types=ctx.settings.problem_types
        )
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim response is not part of the body's size
    return None


async def _route(ctx: ProxyContext, request: web.Request, trace: Trace) -> web.StreamResponse:
    try:
        if not valid_host(request.headers.get(hdrs.HOST)):
            return _refuse_host(ctx, trace)
        if hdrs.TRANSFER_ENCODING in request.headers and transfer_codings(request.headers) != [
            "chunked"
        ]:
            return _refuse_transfer_coding(ctx, trace)
        route = ctx.routes.find(routable_path(request.path), request.host)
        if route is None:
            raise NoRoute()
        trace.route = route
        if request.method not in ctx.governed_methods:
            return await passthrough(ctx, request, route, trace=trace)  # SPEC §4: keys ignored
        key = parse_key(request.headers.getall(ctx.settings.key_header, []))
        if key is None:
            if route.require_key:
                raise KeyMissing()
            return await passthrough(ctx, request, route, trace=trace)
        _refuse_hidden_identity(ctx, request)
        intent, body = await _identify(ctx, request, key)
        trace.owner = intent.owner
        # Positional: a dataclass's keyword call costs twice as much, on every governed request.
        response = await handle_governed(GovernedRequest(ctx, request, route, intent, body, trace))
        if response is None:
            # The store could not take the claim and `on_store_error: passthrough` forwards the
            # request ungoverned (SPEC §11). A response is a mapping: never test it for truth.
            return await passthrough(ctx, request, route, body, trace=trace)
        return response
    except ProblemError as error:
        if isinstance(error, ClientDisconnected):
            client_gone(ctx.metrics, request, DisconnectStage.REQUEST_BODY)
        trace.problem(error)
        return problem_response(
            error, profile=ctx.settings.profile, types=ctx.settings.problem_types
        )


def _refuse_transfer_coding(ctx: ProxyContext, trace: Trace) -> web.StreamResponse:
    """RFC 9112 §6.1: aiohttp removes the final `chunked` of `gzip, chunked` and hands on the
    still-coded bytes as the body; forwarded (and fingerprinted) as the identity body, they
    would mean something else to the upstream. The proxy decodes no other transfer coding, so
    the request is refused, and the connection closed, as for the framings aiohttp refuses."""
    error = HeaderInvalid(
        "The proxy decodes no transfer coding but a single chunked (RFC 9112 §6.1)."
    )
    trace.problem(error)
    response = problem_response(
        error, profile=ctx.settings.profile, types=ctx.settings.problem_types
    )
    response.force_close()
    return response


def _refuse_host(ctx: ProxyContext, trace: Trace) -> web.StreamResponse:
    """RFC 9112 §3.2: 400 for an invalid Host value, and the connection closed, as for the
    framing errors aiohttp's parser refuses (docs/reliability.md, Hostile HTTP)."""
    error = HeaderInvalid("The Host header is not a valid host[:port] (RFC 9112 §3.2).")
    trace.problem(error)
    response = problem_response(
        error, profile=ctx.settings.profile, types=ctx.settings.problem_types
    )
    response.force_close()
    return response


def _refuse_hidden_identity(ctx: ProxyContext, request: web.Request) -> None:
    """RFC 9110 §7.6.1 lets a client list any header in `Connection` to have it stripped. The
    job is scoped by the owner header and keyed by the key header before that stripping, so a
    client listing them would make the backend see another identity than the job's (with a
    gateway-set `header:X-User`, the trusted header would vanish): refuse it."""
    named = hop_by_hop(request.headers)
    identity = {ctx.settings.key_header.lower()}
    if ctx.owner.header is not None:
        identity.add(ctx.owner.header.lower())
    if named & identity:
        raise HeaderInvalid()


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
    content_type = request.headers.get(hdrs.CONTENT_TYPE)
    # Every field, in order (RFC 9110 §5.3: a list may be split over several).
    content_encoding = ",".join(request.headers.getall(hdrs.CONTENT_ENCODING, ()))
    head = FingerprintedHead(
        request.method, url.raw_path, url.raw_query_string, content_type, content_encoding
    )
    if body.spooled:  # hashed as it arrived; too large to canonicalise (proxy/server/body.py)
        digest = fingerprint_of_digest(head, body.raw_sha256)
    else:
        digest = fingerprint(head, body.memory, ctx.settings.fingerprint_exclude)
    intent = Intent(
        owner=owner, key=key, fingerprint=digest, method=request.method, path=url.raw_path
    )
    return intent, body
