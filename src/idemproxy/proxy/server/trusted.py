"""Whose X-Forwarded-* and Forwarded headers are believed (SPEC §10, `trusted_proxies`).

As nginx's `set_real_ip_from`: only a peer inside one of the configured networks is another
proxy whose forwarding headers are kept (X-Forwarded-For appended to). From any other peer they
are what a client wrote, and a backend building redirect URLs, CSRF origins or audit logs from
them would trust the client's word: they are replaced by what this proxy saw.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


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
