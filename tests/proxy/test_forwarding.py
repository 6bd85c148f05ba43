"""SPEC §10: X-Forwarded-* and Forwarded reach the backend as this proxy saw the request, unless
the peer is a configured trusted proxy (`trusted_proxies`, as nginx's set_real_ip_from).

The backend is a real aiohttp server recording every header it receives
(tests/support/backend.py); the client connects from 127.0.0.1, trusted or not depending on the
list.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.backend import Ledger
from tests.support.proxychecks import KEY

from .conftest import ProxyFactory

GOVERNED_OR_NOT = pytest.mark.parametrize(
    ("method", "extra"), [("GET", {}), ("POST", {KEY: "k"})], ids=["passthrough", "governed"]
)
CLAIMED = [
    ("X-Forwarded-For", "203.0.113.7"),
    ("X-Forwarded-Host", "evil.example"),
    ("X-Forwarded-Proto", "https"),
    ("X-Forwarded-Port", "443"),
    ("X-Forwarded-Prefix", "/admin"),
    ("Forwarded", "for=198.51.100.1;host=evil.example;proto=https"),
    ("X-Real-IP", "198.51.100.1"),
    ("True-Client-IP", "198.51.100.1"),
    ("X-Original-URL", "/payments/charge"),
    ("X-Rewrite-URL", "/payments/charge"),
]


async def forward_once(
    proxy: ProxyFactory, ledger: Ledger, method: str, extra: dict[str, str], **settings: Any
) -> tuple[list[tuple[str, str]], str]:
    client = await proxy(**settings)
    async with client.request(method, "/things", headers=[*CLAIMED, *extra.items()]) as answer:
        assert answer.status == 201
    [execution] = ledger.executions
    return execution.headers, f"{client.host}:{client.port}"


def values(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [value for key, value in headers if key.lower() == name.lower()]


@GOVERNED_OR_NOT
@pytest.mark.parametrize(
    "trusted", [None, ["10.0.0.0/8", "::1"]], ids=["default", "loopback-not-listed"]
)
async def test_an_untrusted_peers_forwarding_headers_are_replaced_by_what_the_proxy_saw(
    proxy: ProxyFactory,
    ledger: Ledger,
    method: str,
    extra: dict[str, str],
    trusted: list[str] | None,
) -> None:
    settings = {} if trusted is None else {"trusted_proxies": trusted}
    seen, address = await forward_once(proxy, ledger, method, extra, **settings)
    assert values(seen, "X-Forwarded-For") == ["127.0.0.1"]
    assert values(seen, "X-Forwarded-Host") == [address]
    assert values(seen, "X-Forwarded-Proto") == ["http"]
    # RFC 7239: replaced by this hop's element, as X-Forwarded-* are.
    assert values(seen, "Forwarded") == [f'for=127.0.0.1;host="{address}";proto=http']
    for name, _ in CLAIMED[3:]:
        if name != "Forwarded":
            assert values(seen, name) == [], name


@GOVERNED_OR_NOT
async def test_a_trusted_proxys_forwarding_headers_are_kept_and_for_is_appended(
    proxy: ProxyFactory, ledger: Ledger, method: str, extra: dict[str, str]
) -> None:
    seen, address = await forward_once(
        proxy, ledger, method, extra, trusted_proxies=["10.0.0.0/8", "127.0.0.0/8"]
    )
    assert values(seen, "X-Forwarded-For") == ["203.0.113.7, 127.0.0.1"]
    assert values(seen, "X-Forwarded-Host") == ["evil.example"]
    assert values(seen, "X-Forwarded-Proto") == ["https"]
    # RFC 7239 §4: the trusted proxy's elements kept, this hop's appended.
    assert values(seen, "Forwarded") == [
        f'for=198.51.100.1;host=evil.example;proto=https, for=127.0.0.1;host="{address}";proto=http'
    ]
    for name, value in CLAIMED[3:]:
        if name != "Forwarded":
            assert values(seen, name) == [value], name


async def test_a_trusted_peers_repeated_proto_is_replaced_not_guessed(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy(trusted_proxies=["127.0.0.1"])
    repeated = [("X-Forwarded-Proto", "https"), ("X-Forwarded-Proto", "http")]
    async with client.get("/things", headers=repeated) as answer:
        assert answer.status == 201
    [execution] = ledger.executions
    assert values(execution.headers, "X-Forwarded-Proto") == ["http"]


@pytest.mark.parametrize(
    ("entries", "fragment"),
    [("10.1.2.3/8", "host bits set"), ("proxy.internal", "does not appear to be")],
)
def test_a_bad_trusted_proxies_entry_is_refused_naming_the_field(
    entries: str, fragment: str
) -> None:
    from idemproxy.config.settings import load_settings

    with pytest.raises(ValueError, match="trusted_proxies") as caught:
        load_settings(upstream="http://127.0.0.1:1", trusted_proxies=entries)
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("relayed", "kept"),
    [
        ('for=6.6.6.6;host="x', False),  # appended, this hop's element sat in the open quote
        ('for="[::1', False),
        ('x="\\', False),
        ('for=192.0.2.43, for="[2001:db8:cafe::17]";proto=https', True),
    ],
)
async def test_a_trusted_peers_forwarded_is_appended_to_only_when_it_parses(
    proxy: ProxyFactory, ledger: Ledger, relayed: str, kept: bool
) -> None:
    client = await proxy(trusted_proxies=["127.0.0.1/32"])
    async with client.get("/things", headers={"Forwarded": relayed}) as answer:
        assert answer.status == 201
    [execution] = ledger.executions
    own = f'for=127.0.0.1;host="{client.host}:{client.port}";proto=http'
    assert values(execution.headers, "Forwarded") == [f"{relayed}, {own}" if kept else own]
