"""Header handling on both legs (SPEC §7, §10): the filters, the Host grammar, the request
id (its header, made or taken from the client), and the request's target, Host and headers as
they go upstream (`outgoing`, with the routes' header edits and the trusted proxies).

Every request runs these filters two or three times, so the common case is kept cheap: the
sets of dropped names are built once, and a `Connection` header only costs a set union when it
names a header beyond the fixed hop-by-hop list. The filters copy the headers in one C-level
call and delete the dropped names (multidict matches them case-insensitively), rather than
lower-casing every name in Python.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

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
from idemproxy.randomness import RANDOM_128, refill

if TYPE_CHECKING:
    from aiohttp import web

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
# trusted proxy (`outgoing`, below).
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


# SPEC §7: a replay's status line is the first answer's. An upstream's reason phrase that is not
# the standard one for its status (RFC 9112 §4: informational, but part of the bytes the first
# client got) is stored as the first pair, under the name of the replay's own mark: a field the
# proxy owns, which no version has stored from an upstream or taken in a resolution
# (PROXY_OWNED), and which every version sets anew on a replay. A replica that predates this (a
# rolling upgrade, a rollback) therefore replays such a response as it always did, with the
# standard phrase and `Idempotent-Replayed: true`, never with a field no client expects. A
# response stored without one (the standard phrase, or stored before) is replayed with the
# standard phrase, as aiohttp writes it.
REASON_FIELD = REPLAYED_HEADER
# The phrase a replay is written with when none is stored (aiohttp's: Python's table, or none
# for a status it does not name). Those of the statuses RFC 9110 renamed (413, 414, 416, 422)
# changed in Python 3.13: which one a replay gets depends on the runtime, so a response with one
# of these statuses keeps its phrase whatever it is (None equals no phrase).
_RENAMED = frozenset({413, 414, 416, 422})
STANDARD_REASONS: Final[Mapping[int, str | None]] = {
    status.value: None if status.value in _RENAMED else status.phrase for status in HTTPStatus
}


def stored_reason(pairs: HeaderPairs) -> tuple[str | None, HeaderPairs]:
    """The reason phrase kept with stored headers (None: the standard one) and the headers."""
    if not pairs or pairs[0][0] != REASON_FIELD:
        return None, pairs
    reason = pairs[0][1]
    # Only a phrase a status line may carry, in bytes the client's head can be written in; the
    # proxy stores no other (an upstream's with a control character is not forwarded either:
    # proxy/upstream/client.py), and the replay's own mark replaces any other stray one.
    if _REASON_PHRASE.fullmatch(reason) is None:
        return None, pairs[1:]
    try:
        reason.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None, pairs[1:]
    return reason, pairs[1:]


# RFC 9112 §4: reason-phrase = 1*( HTAB / SP / VCHAR / obs-text ), or empty: no other control
# character (the upstream's test, proxy/upstream/client.py, on the decoded text).
_REASON_PHRASE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")


def response_headers(
    headers: Headers, unreplayed: tuple[str, ...]
) -> tuple[CIMultiDict[str], HeaderPairs]:
    """`response_headers_for_client` and `headers_to_store` of one response at once: what the
    first client gets and what is stored differ only by what a replay recomputes and
    `unreplayed` (SPEC §7), so the second is the first minus those."""
    client = _without(headers, _RESPONSE_DROPPED)
    not_replayed = _not_replayed(unreplayed)
    for name in not_replayed:
        if name in client:
            break
    else:  # nearly never: an upstream's answer brings its Date
        return client, tuple(client.items())
    stored = CIMultiDict[str](client)
    for name in not_replayed:
        if name in stored:
            del stored[name]
    return client, tuple(stored.items())


@functools.lru_cache(maxsize=16)
def _not_replayed(unreplayed: tuple[str, ...]) -> frozenset[str]:
    """What `headers_to_store` drops beyond `response_headers_for_client`."""
    return _store_dropped(unreplayed) - _RESPONSE_DROPPED


def multidict(pairs: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    return CIMultiDict[str](pairs)


# What joins one request's log lines, problem documents, upstream call and trace: its request
# id (the client's `X-Request-Id`, or one made up) and, with tracing on, its trace and span ids
# (docs/operations.md, Logs).
#
# A context variable: set by the request's handler for its whole life and inherited by the tasks
# it starts (an attempt runs in its own task, SPEC §2), read by every log line's formatter.


# A client's id is taken as it is when it is one value of 1-200 visible ASCII characters (what
# nginx's $request_id, Heroku's and the AWS load balancers' ids are); else one is made up.
_ACCEPTED = re.compile(r"[\x21-\x7e]{1,200}")


@dataclass(frozen=True, slots=True)
class Correlation:
    request_id: str
    header: str  # the request id header's name (`request_id_header`)
    # Made up here: it goes upstream too. A client's own id goes upstream as the client sent
    # it, with the rest of its headers.
    made: bool = False
    trace_id: str | None = None  # 32 hex digits (W3C Trace Context), with tracing on
    span_id: str | None = None  # 16 hex digits: the request's server span

    def fields(self) -> dict[str, str]:
        """The ids as log fields, those that are set."""
        found = {"request_id": self.request_id}
        if self.trace_id is not None and self.span_id is not None:
            found["trace_id"], found["span_id"] = self.trace_id, self.span_id
        return found


CURRENT: ContextVar[Correlation | None] = ContextVar("idemproxy_correlation", default=None)


def correlation_of(header: str, values: list[str]) -> Correlation:
    """The request's correlation from the values of its request id header: the client's one
    valid id, else a new one (a UUID). A new one goes upstream only when the client sent none:
    what a client did send reaches the backend as it was sent (a route may key on that very
    header, SPEC §4.1), and the logs then name the id made up here."""
    if len(values) == 1 and _ACCEPTED.fullmatch(values[0]):
        return Correlation(values[0], header)
    return Correlation(new_request_id(), header, made=not values)


_VERSION_4 = 0x4 << 76  # RFC 9562 §5.4
_VARIANT = 0b10 << 62  # RFC 9562 §4.1
_FIXED_BITS = ~(0xF << 76 | 0b11 << 62)


def new_request_id() -> str:
    """A random UUID (version 4) in its canonical 8-4-4-4-12 text, as `str(uuid.uuid4())` but
    without building a uuid.UUID: three Python calls less on every request that brings no id."""
    try:
        value = RANDOM_128.pop()
    except IndexError:
        value = refill()
    value = value & _FIXED_BITS | _VERSION_4 | _VARIANT
    digits = f"{value:032x}"
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def traced(trace_id: int, span_id: int) -> Correlation | None:
    """The current correlation with the request's trace and server span (OpenTelemetry's ids,
    written as W3C Trace Context writes them)."""
    correlation = CURRENT.get()
    if correlation is None:
        return None
    return replace(correlation, trace_id=f"{trace_id:032x}", span_id=f"{span_id:016x}")


def current_fields() -> dict[str, str]:
    """The current request's ids as log fields; none outside a request."""
    correlation = CURRENT.get()
    return {} if correlation is None else correlation.fields()


# The Host header's value (RFC 9112 §3.2, RFC 3986 §3.2.2): `host[:port]`.
#
# RFC 9112 §3.2: a server MUST answer 400 to a request whose Host field value is invalid. aiohttp
# refuses a second Host line but not a value such as `a, b` (a list, as a proxy that merged two
# lines would send), `a b` or `a/b`; the proxy would route by it and forward it, as Host
# (`forward_host: client`, SPEC §10) and as X-Forwarded-Host. The pattern is RFC 3986's host (an
# IP literal in brackets, or a reg-name, which covers IPv4 addresses and names, percent-encoding
# included) and an optional port, with two narrowings:
# * not empty: RFC 9110 §4.2.1, an http(s) URI with an empty host is invalid, and a reverse proxy
#   has no authority to route by or forward (RFC 9112 §3.2 allows it only for targets without one);
# * no `,`: legal in a reg-name but in no DNS name, and `a,b` is two Host lines merged without a
#   space: a backend could take either (the first, the last) for the one this proxy routed by.


_UNRESERVED_AND_SUB_DELIMS = r"A-Za-z0-9\-._~!$&'()*+;="  # sub-delims but `,`
_HOST = re.compile(
    rf"(?:\[[{_UNRESERVED_AND_SUB_DELIMS}:]+\]"  # IP-literal: IPv6 or IPvFuture
    rf"|(?:[{_UNRESERVED_AND_SUB_DELIMS}]|%[0-9A-Fa-f]{{2}})+)"  # reg-name, IPv4address
    r"(?::[0-9]*)?"  # port
)


# Nearly every request of a deployment names one of a few hosts: the pattern's verdict on each
# is kept (bounded), as the match costs a request about 7,000 instructions (bench/compare).
@functools.lru_cache(maxsize=256)
def valid_host(value: str | None) -> bool:
    """Whether a Host value may be routed by and passed on; None (HTTP/1.0 without one) may."""
    return value is None or _HOST.fullmatch(value) is not None


def split_absolute_form(target: str) -> tuple[str, str, str] | None:
    """RFC 9112 §3.2.2: (scheme, authority, origin-form rest) of an absolute-form target, the
    rest as sent (`/` when it has no path, RFC 9112 §3.2.1); None for any other form."""
    if target.startswith("/"):
        return None  # origin-form: the common case, decided on its first character
    scheme, sep, rest = target.partition("://")
    if not sep:
        return None  # asterisk-form, or what the parser let through; the router answers
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    return scheme.lower(), authority, tail if tail.startswith("/") else "/" + tail


def asks_the_server(method: str, target: str) -> bool:
    """RFC 9112 §3.2.4: a question to the server as a whole, not to one of its resources:
    `OPTIONS *`, or OPTIONS with an absolute-form target of no path and no query, which the last
    proxy on the chain sends as `*`."""
    if method != "OPTIONS":
        return False
    if target == "*":
        return True
    _, sep, rest = target.partition("://")
    rest = rest.partition("#")[0]  # a fragment is no part of the target (RFC 9112 §3.2)
    return bool(sep) and "/" not in rest and "?" not in rest


_INVALID_HOST = "The Host header is not a valid host[:port] (RFC 9112 §3.2)."
_DISAGREEING_HOST = (
    "The absolute-form target is not an http(s) URI without userinfo naming the host of the "
    "Host header (RFC 9112 §3.2.2, RFC 9110 §4.2.4)."
)


def host_problem(host: str | None, target: str) -> str | None:
    """Why a request's Host, or its target's authority, is refused (400); None: neither is."""
    if not valid_host(host):
        return _INVALID_HOST
    # Origin-form (every request but one sent as to a forward proxy): nothing to split.
    absolute = None if target.startswith("/") else split_absolute_form(target)
    if absolute is not None and not authority_agrees(absolute[0], absolute[1], host):
        return _DISAGREEING_HOST
    return None


def authority_agrees(scheme: str, authority: str, host: str | None) -> bool:
    """Whether an absolute-form target's authority may stand for the request's Host.

    RFC 9112 §3.2.2 has a server ignore Host for the target's authority; a backend behind this
    proxy receives origin-form and only Host, so two different names would leave the routing
    and the backend each their own. Only http(s) targets, without userinfo (RFC 9110 §4.2.4:
    an error), naming the same host and port as Host (RFC 9110 §4.2.3: a default port is the
    same as none), are accepted; anything else is refused (400) rather than guessed."""
    if scheme not in _DEFAULT_PORTS or not valid_host(authority):
        return False
    if host is None:
        return True  # HTTP/1.0 without Host: the authority alone names the host
    return _normalised(authority, scheme) == _normalised(host, scheme)


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _normalised(value: str, scheme: str) -> tuple[str, str]:
    name, port = value, ""
    if ":" in value and not value.endswith("]"):  # an IP literal's colons are inside brackets
        name, _, port = value.rpartition(":")
    return name.lower().removesuffix("."), port or _DEFAULT_PORTS[scheme]


@functools.lru_cache(maxsize=256)
def host_name(host: str) -> str:
    """The name a Host value (`host[:port]`) routes by: no port, lower-case,
    no trailing dot, percent-decoded. `API.example.com.:443` is the same name in DNS, and with the
    first character only it missed a host route and fell through to one without a host."""
    if host.startswith("["):  # an IP literal: the port follows the bracket (RFC 3986 §3.2.2)
        name = host[: host.find("]") + 1]
    else:
        name = host.rpartition(":")[0] if ":" in host else host
    return unquote(name).lower().removesuffix(".")


# What is sent upstream for a client's request: its URL, its Host and its forwarded headers
# (SPEC §10).
#
# Whose X-Forwarded-* and Forwarded headers are believed (`trusted_proxies`) is decided as nginx's
# `set_real_ip_from` does: only a peer inside one of the configured networks is another proxy
# whose forwarding headers are kept (X-Forwarded-For appended to). From any other peer they are
# what a client wrote, and a backend building redirect URLs, CSRF origins or audit logs from them
# would trust the client's word: they are replaced by what this proxy saw.


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class HeaderEdits:
    """Headers a route or an upstream removes, then sets, on the way upstream
    (`upstream_headers`, config/upstream.py). Applied to the forwarded copy only: the owner and
    the fingerprint come from the client's own request (SPEC §5, §6), and a response stored or
    logged holds none of them."""

    remove: tuple[str, ...] = ()
    set: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # values may be secrets

    def apply(self, headers: CIMultiDict[str]) -> None:
        for name in self.remove:
            headers.popall(name, None)
        for name, value in self.set:
            headers[name] = value


Edits = tuple[HeaderEdits, ...]  # in the order they apply: the route's, then the upstream's


def outgoing(
    request: web.Request,
    upstream: str,
    forward_host: str,
    edits: Edits,
    trusted_proxies: Sequence[Network],
) -> tuple[URL, CIMultiDict[str]]:
    """The URL and the headers the client's request is sent upstream with (SPEC §10).

    The request target goes on byte for byte, no normalisation and no re-encoding: callers
    must pass the URL object on as it is (str() of it is re-parsed and re-quoted by aiohttp,
    %2F -> /). The headers are the client's as `request_headers_for_upstream` forwards them,
    then the route's and the upstream's `edits`, the Host `forward_host` says (none for the
    upstream URL's own authority: the upstream client sends that) and the request id."""
    target = request.raw_path
    if not target.startswith("/"):  # origin-form (`/…`, nearly every request): as it is
        # Off the path of every request, and an operator's command never sends one: aiohttp's
        # import (an HTTP client) stays out of `idemproxy jobs …` (tests/unit/test_cli_help.py).
        from idemproxy.http.as_sent import TARGET_AS_SENT

        target = request.get(TARGET_AS_SENT, target)
        target = "*" if asks_the_server(request.method, target) else _origin_form(target)
    peer = request.remote
    host_sent = request.headers.get("Host")  # `client_host`'s common case, in place
    if host_sent is None:
        host_sent = client_host(request)
    headers = request_headers_for_upstream(
        request.headers,
        client_ip=peer,
        scheme=request.scheme,
        host=host_sent,  # None: an HTTP/1.0 request without one, and nothing to tell (§10)
        # None trusted (the default): no address to parse.
        trusted=bool(trusted_proxies) and is_trusted(peer, trusted_proxies),
    )
    for edit in edits:  # none sets or removes Host (config/upstream.py, PROXY_HEADERS)
        edit.apply(headers)
    # `forward_host`: `auto` is `client` for an http:// upstream (the drop-in and sidecar
    # shapes: the backend sees what the client sent) and `upstream` for an https:// one: TLS to
    # a named host, whose SNI and certificate name the upstream, and whose CDN answers 421 or
    # 403 to a Host that does not name it.
    if forward_host == "auto":
        forward_host = "upstream" if upstream.startswith("https://") else "client"
    if forward_host == "client":
        if host_sent is not None:  # else the upstream URL's authority
            headers["Host"] = host_sent
    elif forward_host != "upstream":
        headers["Host"] = forward_host
    # The request id this proxy made up goes to the upstream too (the backend's logs join),
    # after the edits: a route cannot unset the id the logs are joined by.
    correlation = CURRENT.get()
    if correlation is not None and correlation.made:
        headers.popall(correlation.header, None)
        headers[correlation.header] = correlation.request_id
    if target == "*":  # `OPTIONS *`: the upstream as a whole (`UpstreamClient.request`)
        return URL(upstream, encoded=True), headers
    url = URL(upstream + target, encoded=True)
    if not url.raw_query_string and target.partition("#")[0].endswith("?"):
        # An empty query, which a URL drops: kept at the end of its raw path, so that the
        # target goes on as sent (`/p?`, not `/p`; a fragment is left out, §10).
        url = url.with_path(url.raw_path + "?", encoded=True)
    return url, headers


def _origin_form(target: str) -> str:
    """RFC 9112 §3.2.2: an absolute-form target's path and query ("POST http://host/p"), sent
    in origin-form; glued to the upstream URL whole it made an invalid one."""
    absolute = split_absolute_form(target)
    return target if absolute is None else absolute[2]


def client_host(request: web.Request) -> str | None:
    """The Host the client sent, byte for byte; an absolute-form target's authority when an
    HTTP/1.0 client sent no Host (the handler refused one that disagrees with Host, and an
    HTTP/1.1 request without Host never gets here: aiohttp answers it 400)."""
    host = request.headers.get("Host")
    if host is None:
        absolute = split_absolute_form(request.raw_path)
        if absolute is not None:
            return absolute[1]
    return host


def is_trusted(peer: str | None, networks: Sequence[Network]) -> bool:
    """Whether the peer address `peer` (aiohttp's `request.remote`) lies in `networks`."""
    if not networks or not peer:
        return False  # the default, and a Unix socket peer: nothing to match
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d
    return any(address in network for network in networks)
