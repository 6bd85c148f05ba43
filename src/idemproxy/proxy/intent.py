"""A governed request's body and intent, before any storage call (SPEC §2.1, §6)."""

from __future__ import annotations

from aiohttp import hdrs, web

from idemproxy.core.types import Intent
from idemproxy.errors import OwnerMissing
from idemproxy.http.offload import heavy
from idemproxy.identity.fingerprint import FingerprintedHead, fingerprint, fingerprint_of_digest
from idemproxy.identity.jwt_owner import UNVERIFIED, KeyNotLoaded
from idemproxy.identity.owner import derive_owners
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.server.body import RequestBody, read_body


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
    if memory is None:  # hashed as it arrived; too large to canonicalise (proxy/server/body.py)
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
