"""The Host value check (RFC 9112 §3.2, RFC 3986 §3.2.2)."""

from __future__ import annotations

import pytest

from idemproxy.proxy.server.host import valid_host


@pytest.mark.parametrize(
    "value",
    [
        None,  # HTTP/1.0 may omit it (aiohttp refuses HTTP/1.1 without one)
        "",  # RFC 9112 §3.2: empty when the target has no authority
        "api.example.com",
        "api.example.com:8443",
        "localhost:",  # an empty port is in RFC 3986's grammar
        "127.0.0.1:9000",
        "[::1]",
        "[2001:db8::7]:443",
        "[v1.fe80::a+en1]",  # IPvFuture
        "xn--bcher-kva.example",
        "my%2Dhost",
        "a,b",  # a reg-name may hold sub-delims
    ],
)
def test_valid_hosts(value: str | None) -> None:
    assert valid_host(value)


@pytest.mark.parametrize(
    "value",
    [
        "a, b",  # two values merged into one line
        "a b",
        "example.com/path",
        "user@example.com",
        "example.com:80:80",
        "example.com:http",
        "[::1",
        "::1",
        "%zz",
        "ex\tample",
        "exämple.com",
        "example.com?",
    ],
)
def test_invalid_hosts(value: str) -> None:
    assert not valid_host(value)
