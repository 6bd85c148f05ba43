"""A stored response fitted to the retry it answers (SPEC §7).

The first answer was chosen for the first request: its content coding for that request's
`Accept-Encoding`, its CORS grant for that request's `Origin`. A replay goes to another request,
so these two are checked against it. Everything is derived from the stored response and the
retry's headers: nothing of the first request is stored, and every row stored before this
replays the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from aiohttp import hdrs
from multidict import CIMultiDictProxy

from idemproxy.core.types import HeaderPairs, StoredResponse
from idemproxy.errors import EncodingNotAcceptable
from idemproxy.http.codings import (
    Budget,
    OverBudget,
    Undecodable,
    accepts,
    coding_names,
    decode,
)
from idemproxy.http.offload import in_thread

_ACAO: Final = "access-control-allow-origin"
_ACAO_SIZE: Final = len(_ACAO)
_CE_SIZE: Final = len("content-encoding")
_CORS_PREFIX: Final = "access-control-"
# Fields that describe the coded bytes, untrue of the decoded ones (RFC 9530 §2, §3; RFC 1864).
_CODED_ONLY: Final = frozenset(
    {"content-encoding", "content-digest", "repr-digest", "digest", "content-md5"}
)
# A larger coded body is decoded off the event loop's thread from the start.
_DECODE_INLINE: Final = 64 * 1024
# What a smaller one may cost on the loop (about 0.3 ms of inflating): the work grows with
# what it decodes to, not with its stored bytes (150 bytes of nested gzips held 400,000 empty
# members), so past this a decode is begun again on a thread.
_INLINE_OUTPUT: Final = 256 * 1024
_INLINE_STREAMS: Final = 64


@dataclass(frozen=True, slots=True)
class Fit:
    """What a stored response must change for one retry: its CORS fields dropped, and the
    content codings it must lose (all of them, or none)."""

    drop_cors: bool
    codings: tuple[str, ...]


def unfit(
    stored: StoredResponse, headers: CIMultiDictProxy[str], *, head: bool = False
) -> Fit | None:
    """What `stored` must change to answer a request with `headers`; None, the common case,
    when it goes as stored. The answer to a HEAD (`head`) keeps its coding: it has no content
    to decode, and its fields, the stored Content-Length among them (RFC 9110 §9.3.2), describe
    what the GET got; without them the length would be 0, which would be untrue."""
    coded: list[str] = []
    allowed: list[str] = []
    for name, value in stored.headers:
        # Every replay runs this: a name's length rules out nearly all of them without a copy.
        size = len(name)
        if size == _CE_SIZE and name.lower() == "content-encoding":
            coded.append(value)
        elif size == _ACAO_SIZE and name.lower() == _ACAO:
            allowed.append(value.strip())
    if not coded and not allowed:
        return None
    codings = [] if head else coding_names(coded)
    accepted = headers.getall(hdrs.ACCEPT_ENCODING, None)
    if all(accepts(accepted, coding) for coding in codings):
        codings = []
    drop_cors = bool(allowed) and not _granted(allowed, headers.getall(hdrs.ORIGIN, ()))
    if not codings and not drop_cors:
        return None
    return Fit(drop_cors, tuple(codings))


def _granted(allowed: list[str], origins: list[str] | tuple[()]) -> bool:
    """The stored grant is one this request may see: any origin's (`*`), or its own. Another
    origin's (a response that varied on `Origin`) is never sent to it (Fetch, CORS check)."""
    if allowed == ["*"]:
        return True
    return len(origins) == 1 and allowed == [origins[0].strip()]


async def fitted(stored: StoredResponse, fit: Fit, limit: int) -> StoredResponse:
    """`stored` changed as `fit` says; a decode that does more than a little work is done off
    the event loop's thread (SPEC §7)."""
    body = stored.body
    if fit.codings and body is not None and len(body) > _DECODE_INLINE:
        return await in_thread(fit_response, stored, fit, limit)
    try:
        return fit_response(stored, fit, limit, Budget(_INLINE_OUTPUT, _INLINE_STREAMS))
    except OverBudget:
        # What was decoded is dropped: it is at most the budget, less than the hand-off
        # of its parts to the thread would cost in copies.
        return await in_thread(fit_response, stored, fit, limit)


def fit_response(
    stored: StoredResponse, fit: Fit, limit: int, budget: Budget | None = None
) -> StoredResponse:
    """`stored` with the CORS fields dropped and its body decoded to identity, as `fit` says
    (`EncodingNotAcceptable` when it cannot be: SPEC §7)."""
    headers = stored.headers
    if fit.drop_cors:
        headers = tuple(pair for pair in headers if not pair[0].lower().startswith(_CORS_PREFIX))
    body = stored.body
    if not fit.codings:
        return StoredResponse(stored.status, headers, body)
    if body:  # an omitted or empty body has nothing to decode
        body = _decoded(stored, body, list(fit.codings), limit, budget)
    return StoredResponse(stored.status, _identity(headers), body)


def _decoded(
    stored: StoredResponse, body: bytes, codings: list[str], limit: int, budget: Budget | None
) -> bytes:
    # RFC 9110 §14.4: a range of coded bytes does not decode on its own.
    ranged = stored.status == 206 or any(n.lower() == "content-range" for n, _ in stored.headers)
    try:
        if ranged:
            raise Undecodable()
        return decode(body, codings, limit, budget)
    except Undecodable as exc:
        raise EncodingNotAcceptable(_refusal(codings)) from exc


def _identity(headers: HeaderPairs) -> HeaderPairs:
    """The fields of the same answer sent without its content coding: the coding and what
    describes the coded bytes dropped; a strong ETag weakened (RFC 9110 §8.8.1: the bytes
    differ, the representation does not), as nginx does when it changes a coding."""
    out: list[tuple[str, str]] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered in _CODED_ONLY:
            continue
        weak = lowered == "etag" and not value.lstrip().startswith("W/")
        out.append((name, "W/" + value.lstrip() if weak else value))
    return tuple(out)


def _refusal(codings: list[str]) -> str:
    # Names the coding only when it is a plain token: the bytes are an upstream's.
    names = [c for c in codings if c.isascii() and c.replace("-", "").isalnum() and len(c) < 32]
    named = ", ".join(names) if len(names) == len(codings) else "a content coding"
    return (
        f"The stored response of this job is coded with {named}, which this request's"
        " Accept-Encoding does not accept and the proxy cannot decode; nothing was forwarded."
        " Send it again with the same Idempotency-Key and an Accept-Encoding that names it."
    )
