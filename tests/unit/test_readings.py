"""The paths a backend may resolve a request's path to (proxy/readings.py, SPEC §10)."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from yarl import URL

from idemproxy.errors import PathInvalid
from idemproxy.proxy.readings import (
    changeable,
    opaque,
    readings,
    remove_dot_segments,
    without_authority,
)
from idemproxy.proxy.routing import Route, RouteTable


@pytest.mark.parametrize(
    ("path", "resolved"),
    [
        # RFC 3986 §5.2.4's own examples, and the edges of its loop.
        ("/a/b/c/./../../g", "/a/g"),
        ("/mid/content=5/../6", "/mid/6"),
        ("/..", "/"),
        ("/../..", "/"),
        ("/a/..", "/"),
        ("/a/.", "/a/"),
        ("/a/b/..", "/a/"),
        ("/a//../b", "/a/b"),
        ("/a/...", "/a/..."),
        ("/.well-known/x", "/.well-known/x"),
    ],
)
def test_dot_segments_are_removed_as_rfc_3986_says(path: str, resolved: str) -> None:
    assert remove_dot_segments(path) == resolved


@pytest.mark.parametrize(
    ("path", "reading"),
    [
        ("/public/..;/payments", "/payments"),  # Tomcat: parameters, then dot segments
        ("/public//../payments", "/payments"),  # slashes merged first (nginx)
        ("/public\\..\\payments", "/payments"),  # IIS
        ("/payments. /x", "/payments/x"),  # Windows trims a segment's trailing dots, spaces
        ("/payments\x00/../x", "/payments"),  # a C string ends at NUL
        ("/payments;jsessionid=1", "/payments"),
        ("/payments\n", "/payments"),  # Python's `$` matches before a final newline
        ("/payments\t;x", "/payments"),  # Spring: parameters cut, then the segment trimmed
        ("/\tpayments/x", "/payments/x"),
        ("/public/..\t/payments", "/payments"),
        ("/public/.. /payments", "/payments"),  # `.. ` trimmed is `..`
        ("/public/\x7f../payments", "/payments"),
    ],
)
def test_a_reading_is_what_some_server_resolves_the_path_to(path: str, reading: str) -> None:
    assert changeable(path)
    assert reading in set(readings(path))


@pytest.mark.parametrize(
    ("path", "reading"),
    [
        # RFC 3986 §4.2 (urlsplit, parse_url, URI.getPath, url.Parse): `//evil` is an authority.
        ("//evil/payments", "/payments"),
        ("//x@y/payments/charge", "/payments/charge"),
        ("//evil:8080/payments", "/payments"),
        ("//evil/public/../payments", "/payments"),  # then dot segments removed
        ("//evil/x/..;/payments", "/payments"),
        # WHATWG (Node's `new URL(path, base)`): any run of `/` and `\`, the host ending at `\`.
        ("///evil/payments", "/payments"),
        ("////evil/payments", "/payments"),
        ("/\\evil/payments/refund", "/payments/refund"),
        ("/\\/evil/payments", "/payments"),
        ("//evil\\payments", "/payments"),
        ("//evil", "/"),
        ("//evil?x/payments", "/"),  # a decoded `%3F`: what follows is a query
    ],
)
def test_a_leading_authority_is_dropped_before_the_path_is_read(path: str, reading: str) -> None:
    assert changeable(path)
    assert reading in set(readings(path))


def test_an_authority_is_dropped_as_each_parser_ends_it() -> None:
    # Python's urlsplit: `///evil/x` has an empty authority; WHATWG skips to the host `evil`.
    assert without_authority("///evil/x") == {"/evil/x", "/x"}
    # RFC 3986 ends the authority at `/` only; WHATWG at `\\` too.
    assert without_authority("//a\\b/x") == {"/x", "/b/x"}
    for path in ("/", "/evil/payments", "/a//b", "/.//evil/payments"):
        assert without_authority(path) == set()


@pytest.mark.parametrize("path", ["/", "/v1/payments/charge", "/a.b/c-d_e~f", "/a%2Fb", "/a b/c"])
def test_a_path_no_server_resolves_otherwise_has_no_other_reading(path: str) -> None:
    assert not changeable(path)
    assert list(readings(path)) == []


@pytest.mark.parametrize(
    ("raw", "reading"),
    [
        # WHATWG (Node's `new URL`): dot segments removed on the raw path, `%2e` is a dot.
        ("/a%2Fb/../payments/charge", "/payments/charge"),
        ("/x%2fy/%2e%2e/payments", "/payments"),
        ("/x%2Fy/.%2E/payments", "/payments"),
        ("/public%2Fx/../payments", "/payments"),
        ("/x%2Fy/..%09/payments", "/payments"),  # with the other steps
        ("/x%2Fy;a/../payments", "/payments"),
    ],
)
def test_a_reading_is_also_taken_with_encoded_separators_kept(raw: str, reading: str) -> None:
    decoded = unquote(raw)
    assert changeable(decoded)
    assert reading not in set(readings(decoded))
    assert reading in set(readings(decoded, raw))


def test_an_encoded_separator_stays_in_its_segment_and_nothing_else_does() -> None:
    assert opaque("/a/b%20c") is None  # no %2F nor %5C: the decoded path is the same
    kept = opaque("/a%2Fb%2fc%5Cd%252F%2e")
    assert kept is not None
    assert kept.count("/") == 1
    assert set(readings("/a/b/c\\d%2F.", "/a%2Fb%2fc%5Cd%252F%2e")) >= {"/a/b/c\\d%2F"}


@pytest.mark.parametrize("raw", ["/", "/v1/payments/charge", "/a%2Fb/c", "/a%2Fb/c.d", "/a%2Fb%2F"])
def test_a_path_with_encoded_separators_and_nothing_to_resolve_has_no_other_reading(
    raw: str,
) -> None:
    assert not changeable(unquote(raw))
    assert list(readings(unquote(raw), raw)) == []


def target(raw: str) -> URL:
    """`request.rel_url` for an origin-form target (a path, no query): `URL(raw)` would take a
    leading `//evil` for an authority."""
    return URL.build(path=raw, encoded=True)


ROUTES = RouteTable(
    [
        Route("/payments", None, "http://backend", True, 60.0),
        Route("/public", None, "http://backend", False, 60.0),
        Route("/", None, "http://backend", False, 60.0),
    ]
)
SINGLE = RouteTable([Route("/", None, "http://backend", False, 60.0)])


@pytest.mark.parametrize(
    "raw", ["a;b.txt", "logs//2026.txt", "x/../y.txt", "./rel.txt", "my%20file%20/z.txt",
            "a%2Fb/../payments", "payments%0a", "x%2Fy/..%09/payments",
            # A leading `//authority` (`//evil/payments`): the one route either way.
            "/evil/payments", "//evil/payments", "\\evil/payments/refund", "/x@y/payments/charge",
            "/evil/public/../payments", "/", "%2F/evil/payments"],
)  # fmt: skip
def test_one_route_refuses_no_path(raw: str) -> None:
    raw = "/" + raw
    assert SINGLE.resolve(unquote(raw), None, target(raw)) is SINGLE.routes[0]


@pytest.mark.parametrize(
    ("raw", "prefix"),
    [
        ("/payments/charge", "/payments"),
        ("/payments%2Fcharge", "/payments"),
        ("/public/a%2Fb/../c", "/public"),
        ("/public/my%20file%20/z.txt", "/public"),
        ("/things/a%09b", "/"),
        ("//cdn/images/a.png", "/"),  # no reading leaves the `/` route
        ("//evil", "/"),
        ("/logs//payments", "/"),  # a repeated slash inside the path is no authority
    ],
)
def test_a_path_whose_every_reading_stays_in_its_route_is_routed(raw: str, prefix: str) -> None:
    route = ROUTES.resolve(unquote(raw), None, target(raw))
    assert route is not None
    assert route.prefix == prefix


@pytest.mark.parametrize(
    "raw",
    [
        "/a%2Fb/../payments/charge",
        "/payments%0a",
        "/public/..%20/payments",
        "//evil/payments",
        "///evil/payments",
        "/\\evil/payments/refund",
        "//x@y/payments/charge",
        "//evil/public/../payments",
        "//evil/public/x",  # out of the `/` route into `/public`
        "/%2F/evil/payments",  # decoded before it is parsed
        "/%5C/evil/payments",
    ],
)
def test_a_path_with_a_reading_under_another_route_is_refused(raw: str) -> None:
    with pytest.raises(PathInvalid):
        ROUTES.resolve(unquote(raw), None, target(raw))
