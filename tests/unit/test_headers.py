"""Header handling on both legs (SPEC §7, §10; RFC 9110 §7.6.1)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from idemproxy.http.headers import (
    drop_for_client,
    forwarded_element,
    headers_to_store,
    request_headers_for_upstream,
    response_headers,
    response_headers_for_client,
)


def _headers(*pairs: tuple[str, str]) -> CIMultiDict[str]:
    return CIMultiDict[str](pairs)


def test_hop_by_hop_and_connection_named_headers_are_dropped() -> None:
    incoming = _headers(
        ("Connection", "keep-alive, X-Secret"),
        ("Keep-Alive", "timeout=5"),
        ("TE", "trailers"),
        ("Upgrade", "h2c"),
        ("Proxy-Authorization", "Basic abc"),
        ("Transfer-Encoding", "chunked"),
        ("X-Secret", "do not forward"),
        ("Authorization", "Bearer end-to-end"),
    )
    out = request_headers_for_upstream(incoming, client_ip="10.0.0.1", scheme="http", host="h")
    assert {name.lower() for name in out} >= {"authorization"}
    for dropped in (
        "connection",
        "keep-alive",
        "te",
        "upgrade",
        "proxy-authorization",
        "transfer-encoding",
        "x-secret",
    ):
        assert dropped not in {name.lower() for name in out}


def test_repeated_headers_keep_their_order() -> None:
    incoming = _headers(("X-Tag", "a"), ("Accept", "x"), ("X-Tag", "b"))
    out = request_headers_for_upstream(incoming, client_ip=None, scheme="http", host=None)
    assert out.getall("X-Tag") == ["a", "b"]


def test_forwarded_headers_are_added_and_appended() -> None:
    incoming = _headers(("X-Forwarded-For", "203.0.113.7"), ("Host", "api.example.com"))
    out = request_headers_for_upstream(
        incoming, client_ip="10.0.0.1", scheme="https", host="api.example.com", trusted=True
    )
    assert out["X-Forwarded-For"] == "203.0.113.7, 10.0.0.1"
    assert out["X-Forwarded-Proto"] == "https"
    assert out["X-Forwarded-Host"] == "api.example.com"
    assert "Host" not in out  # the upstream client sets its own


def test_proxy_owned_headers_from_clients_are_not_believed() -> None:
    incoming = _headers(
        ("Idempotent-Replayed", "true"), ("Idempotency-Job", "x"), ("Idempotency-Attempt", "9")
    )
    out = request_headers_for_upstream(incoming, client_ip=None, scheme="http", host=None)
    assert not {"idempotent-replayed", "idempotency-job", "idempotency-attempt"} & {
        name.lower() for name in out
    }


def test_response_headers_drop_framing_and_hop_by_hop() -> None:
    upstream = _headers(
        ("Content-Length", "10"),
        ("Connection", "close"),
        ("Content-Encoding", "gzip"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
    )
    out = response_headers_for_client(upstream)
    assert "Content-Length" not in out and "Connection" not in out
    assert out.getall("Set-Cookie") == ["a=1", "b=2"]
    assert out["Content-Encoding"] == "gzip"


def test_dropped_in_place_as_in_a_copy() -> None:
    """A pass-through response's own fields, dropped in place, are what the copy would be."""
    upstream = _headers(
        ("Content-Length", "10"),
        ("Connection", "close, X-Hop"),
        ("X-Hop", "1"),
        ("Keep-Alive", "timeout=5"),
        ("Set-Cookie", "a=1"),
        ("ETag", '"v1"'),
        ("Set-Cookie", "b=2"),
    )
    fields = CIMultiDict[str](upstream)
    drop_for_client(fields)
    assert list(fields.items()) == list(response_headers_for_client(upstream).items())
    assert list(fields.items()) == [("Set-Cookie", "a=1"), ("ETag", '"v1"'), ("Set-Cookie", "b=2")]


def test_stored_headers_leave_out_date_length_cookies_and_challenges() -> None:
    upstream = _headers(
        ("Date", "Mon, 01 Jan 2024 00:00:00 GMT"),
        ("Content-Length", "10"),
        ("Set-Cookie", "a=1"),
        ("WWW-Authenticate", "Bearer"),
        ("Location", "/payments/1"),
        ("ETag", '"v1"'),
        ("Link", "<a>"),
        ("Link", "<b>"),
    )
    stored = headers_to_store(upstream, ["set-cookie", "www-authenticate", "proxy-authenticate"])
    assert stored == (
        ("Location", "/payments/1"),
        ("ETag", '"v1"'),
        ("Link", "<a>"),
        ("Link", "<b>"),
    )


def test_stored_headers_are_configurable() -> None:
    upstream = _headers(("Set-Cookie", "a=1"), ("X-Request-Id", "r1"))
    assert headers_to_store(upstream, ["x-request-id"]) == (("Set-Cookie", "a=1"),)


def test_connection_naming_a_custom_header_drops_it_on_every_leg() -> None:
    upstream = _headers(
        ("Connection", "X-Hop,  x-other ,"),
        ("X-Hop", "1"),
        ("X-Other", "2"),
        ("ETag", '"v1"'),
    )
    assert list(response_headers_for_client(upstream).items()) == [("ETag", '"v1"')]
    assert headers_to_store(upstream, []) == (("ETag", '"v1"'),)
    incoming = _headers(("Connection", "keep-alive"), ("Connection", "X-Hop"), ("X-Hop", "1"))
    out = request_headers_for_upstream(incoming, client_ip=None, scheme="http", host=None)
    assert list(out.items()) == [
        ("X-Forwarded-Proto", "http"),
        ("Forwarded", "for=unknown;proto=http"),
    ]


def test_connection_naming_only_fixed_hop_by_hop_headers_keeps_the_rest() -> None:
    incoming = _headers(
        ("Connection", "keep-alive"), ("Keep-Alive", "timeout=5"), ("Accept", "x"), ("X-A", "1")
    )
    out = request_headers_for_upstream(incoming, client_ip="10.0.0.1", scheme="http", host=None)
    assert list(out.items()) == [
        ("Accept", "x"),
        ("X-A", "1"),
        ("X-Forwarded-For", "10.0.0.1"),
        ("X-Forwarded-Proto", "http"),
        ("Forwarded", "for=10.0.0.1;proto=http"),
    ]


def test_repeated_headers_keep_their_order_and_case_on_the_way_back() -> None:
    upstream = _headers(
        ("link", "<a>"), ("Content-Length", "2"), ("X-Tag", "t"), ("LINK", "<b>"), ("Date", "d")
    )
    assert list(response_headers_for_client(upstream).items()) == [
        ("link", "<a>"),
        ("X-Tag", "t"),
        ("LINK", "<b>"),
        ("Date", "d"),
    ]
    assert headers_to_store(upstream, ["X-TAG"]) == (("link", "<a>"), ("LINK", "<b>"))


def test_names_are_matched_whatever_their_case() -> None:
    incoming = _headers(
        ("CONTENT-LENGTH", "3"), ("host", "h"), ("TRANSFER-encoding", "chunked"), ("Ok", "1")
    )
    out = request_headers_for_upstream(incoming, client_ip=None, scheme="https", host=None)
    assert list(out.items()) == [
        ("Ok", "1"),
        ("X-Forwarded-Proto", "https"),
        ("Forwarded", "for=unknown;proto=https"),
    ]


def test_an_empty_forwarded_for_without_a_client_address_is_passed_on() -> None:
    incoming = _headers(("X-Forwarded-For", ""), ("X-Forwarded-Proto", "https"))
    out = request_headers_for_upstream(
        incoming, client_ip=None, scheme="http", host="h", trusted=True
    )
    assert list(out.items()) == [
        ("X-Forwarded-For", ""),
        ("X-Forwarded-Proto", "https"),
        ("X-Forwarded-Host", "h"),
        ("Forwarded", "for=unknown;host=h;proto=http"),
    ]


def test_an_untrusted_peers_forwarding_headers_are_replaced() -> None:
    incoming = _headers(
        ("X-Forwarded-For", "203.0.113.7"),
        ("x-forwarded-host", "evil.example"),
        ("X-Forwarded-Proto", "https"),
        ("Forwarded", "for=198.51.100.1"),
        ("X-Real-IP", "198.51.100.1"),
        ("Accept", "x"),
    )
    out = request_headers_for_upstream(incoming, client_ip="10.0.0.1", scheme="http", host="h")
    assert list(out.items()) == [
        ("Accept", "x"),
        ("X-Forwarded-For", "10.0.0.1"),
        ("X-Forwarded-Proto", "http"),
        ("X-Forwarded-Host", "h"),
        ("Forwarded", "for=10.0.0.1;host=h;proto=http"),  # RFC 7239: this hop's, not theirs
    ]


def test_forwarded_is_appended_to_a_trusted_peers_list() -> None:
    """RFC 7239 §4: each proxy appends its element; a trusted proxy's (two lines) come first."""
    incoming = _headers(("Forwarded", "for=203.0.113.7"), ("Forwarded", "for=10.0.0.9"))
    out = request_headers_for_upstream(
        incoming, client_ip="10.0.0.1", scheme="https", host="api.example.com", trusted=True
    )
    assert out.getall("Forwarded") == [
        "for=203.0.113.7, for=10.0.0.9, for=10.0.0.1;host=api.example.com;proto=https"
    ]


@pytest.mark.parametrize(
    ("client_ip", "host", "element"),
    [
        ("192.0.2.60", "example.com", "for=192.0.2.60;host=example.com;proto=http"),
        # RFC 7239 §6: an IPv6 address is bracketed and quoted; §4: `:` is not a token character
        (
            "2001:db8::17",
            "example.com:8080",
            'for="[2001:db8::17]";host="example.com:8080";proto=http',
        ),
        (None, "[::1]:8080", 'for=unknown;host="[::1]:8080";proto=http'),  # §6.3: a Unix socket
        ("192.0.2.60", None, "for=192.0.2.60;proto=http"),
    ],
)
def test_the_forwarded_element_quotes_what_is_not_a_token(
    client_ip: str | None, host: str | None, element: str
) -> None:
    assert forwarded_element(client_ip, "http", host) == element


@pytest.mark.parametrize(
    "relayed",
    [
        'for=6.6.6.6;host="x',  # an unterminated quote: appended, this hop's element sat in it
        'for="[::1',
        'x="\\',
        'for=6.6.6.6, for="x\\"',  # the closing quote is escaped
        "for=6.6.6.6;host=a b",
        "for",
        "",
    ],
)
def test_a_trusted_peers_forwarded_that_is_no_element_list_is_replaced(relayed: str) -> None:
    """RFC 7239 §4; as nginx's documented recipe: appended only to a value that parses."""
    incoming = _headers(("Forwarded", "for=203.0.113.7"), ("Forwarded", relayed))
    out = request_headers_for_upstream(
        incoming, client_ip="10.0.0.1", scheme="https", host="api.example.com", trusted=True
    )
    assert out.getall("Forwarded") == ["for=10.0.0.1;host=api.example.com;proto=https"]


@pytest.mark.parametrize(
    "relayed",
    [
        'for=192.0.2.43, for="[2001:db8:cafe::17]";proto=https',
        'for="_gazonk";by=unknown;host="a\\"b"',  # a quoted-pair
        "For=192.0.2.60;Proto=http;By=203.0.113.43",
        'for=a;;host=b, ,for="é"',  # empty pairs and elements, obs-text
    ],
)
def test_a_trusted_peers_valid_forwarded_list_is_kept_and_appended_to(relayed: str) -> None:
    incoming = _headers(("Forwarded", relayed))
    out = request_headers_for_upstream(
        incoming, client_ip="10.0.0.1", scheme="https", host="api.example.com", trusted=True
    )
    assert out.getall("Forwarded") == [f"{relayed}, for=10.0.0.1;host=api.example.com;proto=https"]


@pytest.mark.parametrize(
    ("fields", "unreplayed"),
    [
        ([("ETag", '"v1"'), ("Content-Type", "text/plain")], ()),
        ([("Date", "Mon, 07 Dec 2026 10:00:00 GMT"), ("ETag", '"v1"')], ()),
        ([("Set-Cookie", "a=1"), ("set-cookie", "b=2"), ("Link", "<a>")], ("set-cookie",)),
        ([("Connection", "x-tag, keep-alive"), ("X-Tag", "1"), ("Date", "d")], ("X-Other",)),
        ([("Content-Length", "3"), ("Transfer-Encoding", "chunked"), ("X-A", "1")], ("date",)),
        ([("WWW-Authenticate", "Basic"), ("X-A", "1"), ("X-A", "2")], ("X-A", "content-length")),
    ],
)
def test_the_client_and_stored_headers_made_at_once_are_those_made_apart(
    fields: list[tuple[str, str]], unreplayed: tuple[str, ...]
) -> None:
    upstream = CIMultiDict(fields)
    client, stored = response_headers(upstream, unreplayed)
    assert list(client.items()) == list(response_headers_for_client(upstream).items())
    assert stored == headers_to_store(upstream, list(unreplayed))
