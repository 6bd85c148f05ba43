"""What is sent upstream for a client's request: its URL and its forwarded headers (SPEC §10).

Whose X-Forwarded-* and Forwarded headers are believed (`trusted_proxies`) is decided as nginx's
`set_real_ip_from` does: only a peer inside one of the configured networks is another proxy
whose forwarding headers are kept (X-Forwarded-For appended to). From any other peer they are
what a client wrote, and a backend building redirect URLs, CSRF origins or audit logs from them
would trust the client's word: they are replaced by what this proxy saw.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from idemproxy.correlation import stamp
from idemproxy.http.headers import request_headers_for_upstream

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class HeaderEdits:
    """Headers a route or an upstream removes, then sets, on the way upstream
    (`upstream_headers`, config_upstream.py). Applied to the forwarded copy only: the owner and
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


def upstream_url(upstream: str, request: web.Request) -> URL:
    # raw_path keeps the client's exact path and query bytes, no re-quoting. Callers must pass
    # this URL object on as it is: str() of it is re-parsed and re-quoted by aiohttp (%2F -> /).
    target = request.raw_path
    if not target.startswith("/"):
        # RFC 9112 §3.2.2: absolute-form ("POST http://host/p"). Only its path and query go on:
        # glued to the upstream URL it made an invalid one (500, and a claimed job never sent).
        target = request.rel_url.raw_path_qs
    return URL(upstream + target, encoded=True)


def forwarded_headers(
    request: web.Request, trusted_proxies: Sequence[Network], edits: Edits = ()
) -> CIMultiDict[str]:
    peer = request.remote
    headers = request_headers_for_upstream(
        request.headers,
        client_ip=peer,
        scheme=request.scheme,
        host=request.host,
        trusted=is_trusted(peer, trusted_proxies),
    )
    for edit in edits:
        edit.apply(headers)
    stamp(headers)  # after the edits: a route cannot unset the id the logs are joined by
    return headers


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
