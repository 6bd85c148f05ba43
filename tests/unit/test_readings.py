"""The paths a backend may resolve a request's path to (proxy/readings.py, SPEC §10)."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from yarl import URL

from idemproxy.errors import PathInvalid
from idemproxy.proxy.readings import changeable, opaque, readings, remove_dot_segments
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
            "a%2Fb/../payments", "payments%0a", "x%2Fy/..%09/payments"],
)  # fmt: skip
def test_one_route_refuses_no_path(raw: str) -> None:
    raw = "/" + raw
    assert SINGLE.resolve(unquote(raw), None, URL(raw, encoded=True)) is SINGLE.routes[0]


@pytest.mark.parametrize(
    ("raw", "prefix"),
    [
        ("/payments/charge", "/payments"),
        ("/payments%2Fcharge", "/payments"),
        ("/public/a%2Fb/../c", "/public"),
        ("/public/my%20file%20/z.txt", "/public"),
        ("/things/a%09b", "/"),
    ],
)
def test_a_path_whose_every_reading_stays_in_its_route_is_routed(raw: str, prefix: str) -> None:
    route = ROUTES.resolve(unquote(raw), None, URL(raw, encoded=True))
    assert route is not None
    assert route.prefix == prefix


@pytest.mark.parametrize(
    "raw", ["/a%2Fb/../payments/charge", "/payments%0a", "/public/..%20/payments"]
)
def test_a_path_with_a_reading_under_another_route_is_refused(raw: str) -> None:
    with pytest.raises(PathInvalid):
        ROUTES.resolve(unquote(raw), None, URL(raw, encoded=True))
