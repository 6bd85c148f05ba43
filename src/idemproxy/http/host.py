"""The Host header's value (RFC 9112 §3.2, RFC 3986 §3.2.2): `host[:port]`.

RFC 9112 §3.2: a server MUST answer 400 to a request whose Host field value is invalid. aiohttp
refuses a second Host line but not a value such as `a, b` (a list, as a proxy that merged two
lines would send), `a b` or `a/b`; the proxy would route by it and forward it, as Host
(`forward_host: client`, SPEC §10) and as X-Forwarded-Host. The pattern is RFC 3986's host (an
IP literal in brackets, or a reg-name, which covers IPv4 addresses and names, percent-encoding
included) and an optional port, with two narrowings:
* not empty: RFC 9110 §4.2.1, an http(s) URI with an empty host is invalid, and a reverse proxy
  has no authority to route by or forward (RFC 9112 §3.2 allows it only for targets without one);
* no `,`: legal in a reg-name but in no DNS name, and `a,b` is two Host lines merged without a
  space: a backend could take either (the first, the last) for the one this proxy routed by.
"""

from __future__ import annotations

import functools
import re
from urllib.parse import unquote

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
    """The name a Host value (`host[:port]`, http/host.py) routes by: no port, lower-case,
    no trailing dot, percent-decoded. `API.example.com.:443` is the same name in DNS, and with the
    first character only it missed a host route and fell through to one without a host."""
    if host.startswith("["):  # an IP literal: the port follows the bracket (RFC 3986 §3.2.2)
        name = host[: host.find("]") + 1]
    else:
        name = host.rpartition(":")[0] if ":" in host else host
    return unquote(name).lower().removesuffix(".")
