"""Identifying a request on a route whose key has another source (SPEC §4.1) or that receives
webhooks (SPEC §4.2): the signature is verified, and the key found, before any storage call."""

from __future__ import annotations

from aiohttp import web

from idemproxy.core.types import Intent
from idemproxy.errors import HeaderInvalid, KeyInvalid, KeyMissing
from idemproxy.http.headers import hop_by_hop
from idemproxy.identity.key_source import KeySource
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.intent import governed_body, intent_of, request_owners
from idemproxy.proxy.jobs.request import OwnerTransition
from idemproxy.proxy.routing import Route
from idemproxy.proxy.server.body import RequestBody


async def identify_sourced(
    ctx: ProxyContext, request: web.Request, route: Route, source: KeySource
) -> tuple[Intent | None, RequestBody, OwnerTransition | None]:
    """The intent, the body and the owner transition (SPEC §5, as `handler._identify`'s); the
    intent is None when the source gives no key and the route passes such requests through
    (`require_key`, SPEC §4.1)."""
    webhook = route.webhook
    legacy = None  # a webhook's owner is its sender's name, never peppered
    if webhook is None:
        owner, legacy = await request_owners(ctx, request)  # SPEC §5, as for key_header
        body = await governed_body(ctx, request, in_memory=source.needs_body)
    else:
        body = await governed_body(ctx, request, in_memory=True)
        # SPEC §4.2: nothing is claimed, stored or forwarded for a delivery that is not signed.
        webhook.verify(request.headers, body.memory)
        owner = webhook.owner
    key = _key(route, source, request, body)
    if key is None:
        return None, body, None
    if source.header is not None:
        refuse_hidden_identity(ctx, request, source.header)
    transition = None if legacy is None else OwnerTransition(owner, legacy)
    return intent_of(ctx, request, owner, key, body), body, transition


def _key(route: Route, source: KeySource, request: web.Request, body: RequestBody) -> str | None:
    """SPEC §4.1: a source that is absent or not a valid key is `require_key`'s to decide."""
    try:
        key = source.key(request.headers, b"" if body.spooled else body.memory)
    except KeyInvalid:
        if route.require_key:
            raise
        return None
    if key is None and route.require_key:
        raise KeyMissing()
    return key


def refuse_hidden_identity(ctx: ProxyContext, request: web.Request, key_header: str) -> None:
    """RFC 9110 §7.6.1 lets a client list any header in `Connection` to have it stripped. The
    job is scoped by the owner header and keyed by the key header before that stripping, so a
    client listing them would make the backend see another identity than the job's (with a
    gateway-set `header:X-User`, the trusted header would vanish): refuse it."""
    named = hop_by_hop(request.headers)
    identity = {key_header.lower()}
    if ctx.owner.header is not None:
        identity.add(ctx.owner.header.lower())
    if named & identity:
        raise HeaderInvalid()
