"""Header handling on both legs (SPEC §7, §10)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from multidict import CIMultiDict, CIMultiDictProxy

from idemproxy.constants import (
    ATTEMPT_HEADER,
    HOP_BY_HOP_HEADERS,
    JOB_HEADER,
    REPLAY_OMITTED_HEADER,
    REPLAYED_HEADER,
)
from idemproxy.types import HeaderPairs

# The proxy alone speaks these; a client or an upstream that sends them is not believed.
PROXY_OWNED = frozenset(
    h.lower() for h in (REPLAYED_HEADER, REPLAY_OMITTED_HEADER, JOB_HEADER, ATTEMPT_HEADER)
)
# Recomputed by whoever sends the message next; `Expect` was already answered by this proxy.
_FRAMING = frozenset({"content-length", "host", "expect"})
# SPEC §7: a replay gets a fresh Date and a recomputed Content-Length.
_NOT_STORED = frozenset({"content-length", "date"})

Headers = CIMultiDictProxy[str] | CIMultiDict[str]


def hop_by_hop(headers: Headers) -> frozenset[str]:
    """RFC 9110 §7.6.1: the fixed list plus every header named in `Connection`."""
    named = {
        token.strip().lower()
        for value in headers.getall("Connection", ())
        for token in value.split(",")
        if token.strip()
    }
    return HOP_BY_HOP_HEADERS | named


def request_headers_for_upstream(
    headers: Headers,
    *,
    client_ip: str | None,
    scheme: str,
    host: str | None,
) -> CIMultiDict[str]:
    """The client's headers minus hop-by-hop and proxy-owned ones, plus X-Forwarded-* (SPEC §10).

    Repeated headers keep their order. Host and Content-Length are set by the upstream client.
    """
    dropped = hop_by_hop(headers) | PROXY_OWNED | _FRAMING
    out = CIMultiDict[str](
        (name, value) for name, value in headers.items() if name.lower() not in dropped
    )
    forwarded_for = ", ".join(
        [*headers.getall("X-Forwarded-For", ()), *([client_ip] if client_ip else [])]
    )
    if forwarded_for:
        out.popall("X-Forwarded-For", None)
        out["X-Forwarded-For"] = forwarded_for
    out.setdefault("X-Forwarded-Proto", scheme)
    if host:
        out.setdefault("X-Forwarded-Host", host)
    return out


def response_headers_for_client(headers: Headers) -> CIMultiDict[str]:
    """The upstream's response headers minus hop-by-hop, framing and proxy-owned ones."""
    dropped = hop_by_hop(headers) | PROXY_OWNED | {"content-length"}
    return CIMultiDict[str]((n, v) for n, v in headers.items() if n.lower() not in dropped)


def headers_to_store(headers: Headers, unreplayed: Collection[str]) -> HeaderPairs:
    """SPEC §7: end-to-end headers only; Set-Cookie and auth challenges not kept by default."""
    dropped = hop_by_hop(headers) | PROXY_OWNED | _NOT_STORED | {h.lower() for h in unreplayed}
    return tuple((n, v) for n, v in headers.items() if n.lower() not in dropped)


def multidict(pairs: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    return CIMultiDict[str](pairs)
