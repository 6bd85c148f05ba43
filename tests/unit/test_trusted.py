"""SPEC §10: which peers are trusted proxies (`trusted_proxies`)."""

from __future__ import annotations

import ipaddress

import pytest

from idemproxy.http.headers import is_trusted

NETWORKS = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8::/32")]


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("10.1.2.3", True),
        ("::ffff:10.1.2.3", True),  # an IPv4 peer on a dual-stack listener
        ("2001:db8::1", True),
        ("11.0.0.1", False),
        ("127.0.0.1", False),
        ("fe80::1%eth0", False),
        ("", False),
        (None, False),  # a Unix socket peer
    ],
)
def test_only_peers_inside_a_listed_network_are_trusted(peer: str | None, expected: bool) -> None:
    assert is_trusted(peer, NETWORKS) is expected


def test_nobody_is_trusted_by_default() -> None:
    assert not is_trusted("127.0.0.1", [])
