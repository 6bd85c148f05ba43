"""The Host header's value (RFC 9112 §3.2, RFC 3986 §3.2.2): `host[:port]`, or empty.

RFC 9112 §3.2: a server MUST answer 400 to a request whose Host field value is invalid. aiohttp
refuses a second Host line but not a value such as `a, b` (a list, as a proxy that merged two
lines would send), `a b` or `a/b`; the proxy would route by it and forward it as
X-Forwarded-Host. The pattern is RFC 3986's host (an IP literal in brackets, or a reg-name,
which covers IPv4 addresses and names, percent-encoding included) and an optional port.
"""

from __future__ import annotations

import functools
import re

_UNRESERVED_AND_SUB_DELIMS = r"A-Za-z0-9\-._~!$&'()*+,;="
_HOST = re.compile(
    rf"(?:\[[{_UNRESERVED_AND_SUB_DELIMS}:]+\]"  # IP-literal: IPv6 or IPvFuture
    rf"|(?:[{_UNRESERVED_AND_SUB_DELIMS}]|%[0-9A-Fa-f]{{2}})*)"  # reg-name, IPv4address
    r"(?::[0-9]*)?"  # port
)


# Nearly every request of a deployment names one of a few hosts: the pattern's verdict on each
# is kept (bounded), as the match costs a request about 7,000 instructions (bench/compare).
@functools.lru_cache(maxsize=256)
def valid_host(value: str | None) -> bool:
    """Whether a Host value may be routed by and passed on; None (HTTP/1.0 without one) may."""
    return value is None or _HOST.fullmatch(value) is not None
