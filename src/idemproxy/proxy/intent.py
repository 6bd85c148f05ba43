"""A governed request's body and intent, before any storage call (SPEC §2.1, §6)."""

from __future__ import annotations

from aiohttp import hdrs, web

from idemproxy.constants import HOP_BY_HOP_HEADERS
from idemproxy.core.types import Intent
from idemproxy.errors import (
    BodyEncodingUnsupported,
    HeaderInvalid,
    KeyAmbiguous,
    KeyInvalid,
    KeyMissing,
    OwnerMissing,
    OwnerUnstable,
)
from idemproxy.http.codings import Undecodable, coding_names, decode
from idemproxy.http.headers import hop_by_hop
from idemproxy.http.offload import heavy, off_loop
from idemproxy.identity.fingerprint import FingerprintedHead, fingerprint, fingerprint_of_digest
from idemproxy.identity.jwt_owner import UNVERIFIED, KeyNotLoaded
from idemproxy.identity.key_source import KeySource
from idemproxy.identity.owner import derive_owners
from idemproxy.identity.webhooks import WebhookVerifier
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.jobs.request import OwnerTransition
from idemproxy.proxy.routing import Route
from idemproxy.proxy.server.connection import RequestBody, read_body


async def governed_body(
    ctx: ProxyContext, request: web.Request, *, in_memory: bool = False
) -> RequestBody:
    """The whole body, bounded (SPEC §9); `in_memory` keeps it out of the spool file, for the
    routes that read it before the claim (a JSON Pointer key, a webhook's signature)."""
    settings = ctx.settings
    limit = settings.max_request_body
    return await read_body(
        request,
        limit=limit,
        timeout=settings.server.body_read_timeout,
        spool_threshold=limit if in_memory else settings.server.spool_threshold,
    )


async def request_owners(ctx: ProxyContext, request: web.Request) -> tuple[str, str | None]:
    """SPEC §5: the request's owner, and in the transition to `owner.pepper` the one its
    credential had before (`derive_owners`), waiting for the identity provider's keys when its
    token names a key none of them held."""
    try:
        return derive_owners(ctx.owner, request.headers, request.rel_url.raw_query_string)
    except KeyNotLoaded as missing:
        return await owners_after_refresh(ctx, request, missing)


async def owners_after_refresh(
    ctx: ProxyContext, request: web.Request, missing: KeyNotLoaded
) -> tuple[str, str | None]:
    """SPEC §5: a token with a kid none of the identity provider's keys held has: wait (at most
    owner.jwt.idp.timeout) for them to be fetched again, then verify once more. The key still
    missing then is `401 owner-missing`; no key set fetched is `503 identity-unavailable`."""
    await missing.wait()
    try:
        return derive_owners(ctx.owner, request.headers, request.rel_url.raw_query_string)
    except KeyNotLoaded as again:
        raise OwnerMissing(UNVERIFIED) from again


def intent_of(
    ctx: ProxyContext, request: web.Request, owner: str, key: str, body: RequestBody
) -> Intent:
    """SPEC §6: the fingerprint over the request as it arrived, whatever the key's source; on
    the loop, for a body that is not `heavy` (see `intent_off_loop`)."""
    url, headers = request.rel_url, request.headers
    # `_head`, in place: every governed request. Every field of Content-Encoding, in order
    # (RFC 9110 §5.3: a list may be split over several).
    content_encoding = ",".join(headers.getall(hdrs.CONTENT_ENCODING, ()))
    head = (
        request.method,
        url.raw_path,
        url.raw_query_string,
        headers.get(hdrs.CONTENT_TYPE),
        content_encoding,
    )
    memory = body.memory
    if (
        memory is None
    ):  # hashed as it arrived; too large to canonicalise (proxy/server/connection.py)
        form = body.form_sha256
        if form is None:
            digest = fingerprint_of_digest(head, body.raw_sha256)
        else:  # a body its client may encode anew, hashed as the fingerprint takes it
            digest = fingerprint_of_digest(head, form, body.form_media_type)
    else:
        digest = fingerprint(head, memory, ctx.settings.fingerprint_exclude)
    return Intent(owner=owner, key=key, fingerprint=digest, method=head[0], path=head[1])


async def intent_off_loop(
    ctx: ProxyContext, request: web.Request, owner: str, key: str, body: RequestBody
) -> Intent:
    """`intent_of`, with a `heavy` body canonicalised off the event loop (http/offload.py)."""
    memory = body.memory
    if memory is None or not heavy(memory):
        return intent_of(ctx, request, owner, key, body)
    head = _head(request)
    exclude = ctx.settings.fingerprint_exclude
    digest = await ctx.offload(memory, fingerprint, head, memory, exclude)
    return Intent(owner=owner, key=key, fingerprint=digest, method=head[0], path=head[1])


def _head(request: web.Request) -> FingerprintedHead:
    url = request.rel_url
    # Every field, in order (RFC 9110 §5.3: a list may be split over several).
    content_encoding = ",".join(request.headers.getall(hdrs.CONTENT_ENCODING, ()))
    return (
        request.method,
        url.raw_path,
        url.raw_query_string,
        request.headers.get(hdrs.CONTENT_TYPE),
        content_encoding,
    )


# Identifying a request on a route whose key has another source (SPEC §4.1) or that receives
# webhooks (SPEC §4.2): the signature is verified, and the key found, before any storage call.


async def identify_sourced(
    ctx: ProxyContext, request: web.Request, route: Route, source: KeySource
) -> tuple[Intent | None, RequestBody | None, OwnerTransition | None]:
    """The intent, the body (None: not read) and the owner transition (SPEC §5, as
    `handler._identify`'s); the intent is None when the source gives no key and the route
    passes such requests through (`require_key`, SPEC §4.1)."""
    if route.webhook is not None:  # its owner is the sender's name, never peppered
        intent, body = await _identify_delivery(ctx, request, route, source, route.webhook)
        return intent, body, None
    if source.needs_body:
        owners: tuple[str, str | None] | OwnerUnstable
        try:
            owners = await request_owners(ctx, request)  # SPEC §5, as for key_header
        except OwnerUnstable as unstable:  # refused only if the body turns out to have a key
            owners = unstable
        body = await governed_body(ctx, request, in_memory=True)
        key = await _key(ctx, route, source, request, body.memory or b"")
        if key is None:
            return None, body, None
        if isinstance(owners, OwnerUnstable):
            raise owners
        owner, legacy = owners
    else:
        # SPEC §4, §9: without its key header the request is not governed and passes through
        # with its body unread (and not bounded), as on a route keyed by `key_header`.
        key = await _key(ctx, route, source, request, b"")
        if key is None:
            return None, None, None
        refuse_hidden(request, source.header)
        owner, legacy = await request_owners(ctx, request)
        body = await governed_body(ctx, request)
    # SPEC §5: the owner header named in `Connection` is refused whatever gives the key.
    refuse_hidden(request, ctx.owner.header)
    transition = None if legacy is None else OwnerTransition(owner, legacy)
    return await intent_off_loop(ctx, request, owner, key, body), body, transition


async def _identify_delivery(
    ctx: ProxyContext,
    request: web.Request,
    route: Route,
    source: KeySource,
    webhook: WebhookVerifier,
) -> tuple[Intent | None, RequestBody]:
    """SPEC §4.2: nothing is claimed, stored or forwarded for a delivery that is not signed.
    The owner is the sender, so the owner header is no part of the delivery's identity."""
    body = await governed_body(ctx, request, in_memory=True)
    memory = body.held()
    await off_loop(memory, webhook.verify, request.headers, memory)
    key = await _key(ctx, route, source, request, memory)
    if key is None:
        return None, body
    refuse_hidden(request, source.header)
    return await intent_off_loop(ctx, request, webhook.owner, key, body), body


async def _key(
    ctx: ProxyContext, route: Route, source: KeySource, request: web.Request, body: bytes
) -> str | None:
    """SPEC §4.1: a source that is absent or not a valid key is `require_key`'s to decide. A
    large body is parsed off the event loop (http/offload.py)."""
    try:
        if source.needs_body:
            codings = coding_names(request.headers.getall("Content-Encoding", ()))
            if codings:
                limit = ctx.settings.max_request_body
                key = await ctx.offload.coded(coded_body_key, source, body, codings, limit)
            else:
                key = await ctx.offload(body, source.body_key, body)
        else:
            key = source.key(request.headers, body)
    except KeyInvalid as invalid:
        if route.require_key or isinstance(invalid, KeyAmbiguous):
            raise
        return None
    if key is None and route.require_key:
        raise KeyMissing()
    return key


def coded_body_key(source: KeySource, body: bytes, codings: list[str], limit: int) -> str | None:
    """SPEC §4.1: the key of a body sent with a content coding, read from the decoded JSON (the
    bytes forwarded and fingerprinted stay as sent). One that cannot be decoded is refused
    rather than passed through: its key may name an intent that already ran. Module-level, so
    that a body parsing process can run it (http/offload.py)."""
    try:
        decoded = decode(body, codings, limit)
    except Undecodable:
        raise BodyEncodingUnsupported(
            f"The body's Content-Encoding ({', '.join(codings)}) could not be decoded to read "
            "the route's key from it: only gzip and deflate are, up to max_request_body bytes "
            "decoded. Send it uncoded or in one of those."
        ) from None
    return source.body_key(decoded)


def refuse_hidden(request: web.Request, name: str | None) -> None:
    """`refuse_hidden_identity` for one header (None: none to check), off the default path."""
    if name is not None and name.lower() in hop_by_hop(request.headers):
        raise HeaderInvalid()


def refuse_hidden_identity(ctx: ProxyContext, request: web.Request, key_header: str) -> None:
    """RFC 9110 §7.6.1 lets a client list any header in `Connection` to have it stripped. The
    job is scoped by the owner header and keyed by the key header before that stripping, so a
    client listing them would make the backend see another identity than the job's (with a
    gateway-set `header:X-User`, the trusted header would vanish): refuse it."""
    headers = request.headers
    # `hop_by_hop`'s common case, no `Connection` header, in place: every governed request.
    named = HOP_BY_HOP_HEADERS if hdrs.CONNECTION not in headers else hop_by_hop(headers)
    identity = {key_header.lower()}
    if ctx.owner.header is not None:
        identity.add(ctx.owner.header.lower())
    if named & identity:
        raise HeaderInvalid()
