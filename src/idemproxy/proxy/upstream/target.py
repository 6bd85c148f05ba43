"""What is sent upstream for a client's request: its URL, its Host and its forwarded headers
(SPEC §10).

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

from aiohttp import hdrs, web
from multidict import CIMultiDict
from yarl import URL

from idemproxy.http.as_sent import TARGET_AS_SENT
from idemproxy.http.correlation import CURRENT
from idemproxy.http.headers import request_headers_for_upstream
from idemproxy.http.host import asks_the_server, split_absolute_form

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
        target = request.get(TARGET_AS_SENT, target)
        target = "*" if asks_the_server(request.method, target) else _origin_form(target)
    peer = request.remote
    host_sent = request.headers.get(hdrs.HOST)  # `client_host`'s common case, in place
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
            headers[hdrs.HOST] = host_sent
    elif forward_host != "upstream":
        headers[hdrs.HOST] = forward_host
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
    host = request.headers.get(hdrs.HOST)
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
