"""The paths a backend may resolve a request's path to (proxy/readings.py, SPEC §10)."""

from __future__ import annotations

import pytest

from idemproxy.proxy.readings import changeable, readings, remove_dot_segments


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
    ],
)
def test_a_reading_is_what_some_server_resolves_the_path_to(path: str, reading: str) -> None:
    assert changeable(path)
    assert reading in set(readings(path))


@pytest.mark.parametrize("path", ["/", "/v1/payments/charge", "/a.b/c-d_e~f", "/a%2Fb", "/a b/c"])
def test_a_path_no_server_resolves_otherwise_has_no_other_reading(path: str) -> None:
    assert not changeable(path)
    assert list(readings(path)) == []
