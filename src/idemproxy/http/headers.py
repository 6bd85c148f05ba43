"""Header handling on both legs (SPEC §7, §10).

Every request runs these filters two or three times, so the common case is kept cheap: the
sets of dropped names are built once, and a `Connection` header only costs a set union when it
names a header beyond the fixed hop-by-hop list. The filters copy the headers in one C-level
call and delete the dropped names (multidict matches them case-insensitively), rather than
lower-casing every name in Python.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable

from multidict import CIMultiDict, CIMultiDictProxy

from idemproxy.constants import (
    ATTEMPT_HEADER,
    ERROR_HEADER,
    FORWARDING_HEADERS,
    HOP_BY_HOP_HEADERS,
    JOB_HEADER,
    REPLAY_OMITTED_HEADER,
    REPLAYED_HEADER,
)
from idemproxy.core.types import HeaderPairs

# The proxy alone speaks these; a client or an upstream that sends them is not believed. An
# upstream's `Idempotency-Error` would make clients (and the batch runner) take a backend answer,
# a 200 even, for the proxy's refusal (SPEC §8): it is neither passed on nor stored.
PROXY_OWNED = frozenset(
    h.lower()
    for h in (REPLAYED_HEADER, REPLAY_OMITTED_HEADER, JOB_HEADER, ATTEMPT_HEADER, ERROR_HEADER)
)
# Recomputed by whoever sends the message next; `Expect` was already answered by this proxy.
_FRAMING = frozenset({"content-length", "host", "expect"})
# SPEC §7: a replay gets a fresh Date and a recomputed Content-Length.
_NOT_STORED = frozenset({"content-length", "date"})
# RFC 7239 §4: a parameter value is a token or a quoted-string; RFC 9110 §5.6.2's tchar.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 7239 §4: Forwarded = 1#forwarded-element, an element `pair *( ";" pair )` with
# `pair = token "=" ( token / quoted-string )` (RFC 9110 §5.6.4: qdtext, quoted-pair,
# obs-text). Checked as pairs separated by `;` or `,`, empty ones and whitespace around them
# tolerated: each space, separator and character has one place in the pattern, so a crafted
# value cannot make it backtrack. A value it does not match (an unterminated quote) would
# swallow the element this proxy appends after it.
_QUOTED = r'"(?:[\t !#-\[\]-~\x80-\U0010ffff]|\\[\t -~\x80-\U0010ffff])*"'
_PAIR = rf"{_TOKEN.pattern}=(?:{_TOKEN.pattern}|{_QUOTED})"
_ITEM = rf"[ \t]*(?:{_PAIR}[ \t]*)?"
_FORWARDED = re.compile(rf"{_ITEM}(?:[;,]{_ITEM})*")
# What each filter drops when `Connection` names nothing beyond the fixed list.
_REQUEST_DROPPED = HOP_BY_HOP_HEADERS | PROXY_OWNED | _FRAMING
# SPEC §10: what a client claims about the hops before this proxy is believed only from a
# trusted proxy (proxy/upstream/client.py).
_UNTRUSTED_DROPPED = _REQUEST_DROPPED | FORWARDING_HEADERS
_RESPONSE_DROPPED = HOP_BY_HOP_HEADERS | PROXY_OWNED | frozenset({"content-length"})
_STORE_DROPPED = HOP_BY_HOP_HEADERS | PROXY_OWNED | _NOT_STORED
_NONE: frozenset[str] = frozenset()

Headers = CIMultiDictProxy[str] | CIMultiDict[str]


def connection_named(headers: Headers) -> frozenset[str]:
    """The header names listed in `Connection` (RFC 9110 §7.6.1), lower-cased."""
    values = headers.getall("Connection", None)
    return _NONE if values is None else _named(values)


def _named(values: list[str]) -> frozenset[str]:
    return frozenset(
        token.strip().lower() for value in values for token in value.split(",") if token.strip()
    )


def hop_by_hop(headers: Headers) -> frozenset[str]:
    """RFC 9110 §7.6.1: the fixed list plus every header named in `Connection`."""
    values = headers.getall("Connection", None)
    return HOP_BY_HOP_HEADERS if values is None else _with_named(HOP_BY_HOP_HEADERS, values)


def _with_named(dropped: frozenset[str], values: list[str]) -> frozenset[str]:
    named = _named(values)
    # `Connection: keep-alive` or `close` adds nothing that is not dropped already (or, for
    # `close`, only a header name nobody sends): no new set for the common case.
    return dropped if named <= dropped else dropped | named


def _without(headers: Headers, dropped: frozenset[str]) -> CIMultiDict[str]:
    """A copy minus every header named in `dropped` (lower-case) or in `Connection`, repeated
    ones kept in order. Most messages have no `Connection` header (HTTP/1.1 keeps alive by
    default): they cost no call beyond this one."""
    out = CIMultiDict[str](headers)
    values = out.getall("Connection", None)  # `_drop`, in place: every request runs it thrice
    if values is not None:
        dropped = _with_named(dropped, values)
    for name in dropped:
        if name in out:
            del out[name]
    return out


def _drop(headers: CIMultiDict[str], dropped: frozenset[str]) -> None:
    values = headers.getall("Connection", None)
    if values is not None:
        dropped = _with_named(dropped, values)
    for name in dropped:
        if name in headers:
            del headers[name]


def request_headers_for_upstream(
    headers: Headers,
    *,
    client_ip: str | None,
    scheme: str,
    host: str | None,
    trusted: bool = False,
) -> CIMultiDict[str]:
    """The client's headers minus hop-by-hop and proxy-owned ones, plus X-Forwarded-* and
    Forwarded (SPEC §10).

    Repeated headers keep their order. Host and Content-Length are set by the upstream client.
    From a `trusted` peer (another proxy) its forwarding headers are kept, and X-Forwarded-For
    and Forwarded are appended to; from any other peer they are replaced by what this proxy saw.
    `host` is the Host the client sent (None: an HTTP/1.0 request without one).
    """
    out = _without(headers, _REQUEST_DROPPED if trusted else _UNTRUSTED_DROPPED)
    earlier = headers.getall("X-Forwarded-For", None) if trusted else None
    if earlier is None:
        forwarded_for = client_ip
    else:
        forwarded_for = ", ".join([*earlier, client_ip] if client_ip else earlier)
    if forwarded_for:
        out.popall("X-Forwarded-For", None)
        out["X-Forwarded-For"] = forwarded_for
    for name, value in (("X-Forwarded-Proto", scheme), ("X-Forwarded-Host", host)):
        if not value:
            continue  # no Host: an HTTP/1.0 request without one
        # A trusted proxy's one value stands; a repeated one (two hops that appended) cannot
        # say which is the client's, so this proxy's view replaces both.
        values = out.getall(name, None)
        if values is None or len(values) > 1:
            out.popall(name, None)
            out[name] = value
    # RFC 7239 §4: each proxy appends its element to the list; a trusted peer's elements (kept,
    # in `out`) come first, in the order their lines came, and the whole list is one line. A
    # line that is not a forwarded-element list (`for=x;host="y`, relayed by the trusted peer
    # from its client) is replaced by this hop's element, as nginx's documented recipe does:
    # appended, it would sit inside the open quoted string, and the backend would read none of
    # this proxy's element.
    element = forwarded_element(client_ip, scheme, host)
    earlier = out.popall("Forwarded", None)
    if earlier is None or not all(_is_forwarded(line) for line in earlier):
        out["Forwarded"] = element
    else:
        out["Forwarded"] = ", ".join([*earlier, element])
    return out


def forwarded_element(client_ip: str | None, scheme: str, host: str | None) -> str:
    """RFC 7239 §4: this hop's `for`, `host` and `proto`. An IPv6 address is bracketed and
    quoted (§6), a peer without an address (a Unix socket) is `unknown` (§6.3), and a value
    that is not a token (`host:port`) is a quoted-string; a valid Host holds no `"` or `\\`."""
    if not client_ip:
        node = "unknown"
    elif ":" in client_ip:
        node = f'"[{client_ip}]"'
    else:
        node = client_ip
    if not host:
        return f"for={node};proto={scheme}"
    value = host if _TOKEN.fullmatch(host) else f'"{host}"'
    return f"for={node};host={value};proto={scheme}"


def _is_forwarded(line: str) -> bool:
    return "=" in line and _FORWARDED.fullmatch(line) is not None


def response_headers_for_client(headers: Headers) -> CIMultiDict[str]:
    """The upstream's response headers minus hop-by-hop, framing and proxy-owned ones."""
    return _without(headers, _RESPONSE_DROPPED)


def drop_for_client(headers: CIMultiDict[str]) -> None:
    """`response_headers_for_client` in place, for fields already copied into a response's
    own (aiohttp copies those it is given: one copy, not two)."""
    _drop(headers, _RESPONSE_DROPPED)


def headers_to_store(headers: Headers, unreplayed: Collection[str]) -> HeaderPairs:
    """SPEC §7: end-to-end headers only; Set-Cookie and auth challenges not kept by default."""
    return tuple(_without(headers, _store_dropped(tuple(unreplayed))).items())


@functools.lru_cache(maxsize=16)
def _store_dropped(unreplayed: tuple[str, ...]) -> frozenset[str]:
    # The setting is one list for the process's life: lower-cased and merged once, not per call.
    return _STORE_DROPPED | {h.lower() for h in unreplayed}


def multidict(pairs: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    return CIMultiDict[str](pairs)
