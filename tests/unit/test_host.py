"""The Host value check (RFC 9112 §3.2, RFC 3986 §3.2.2)."""

from __future__ import annotations

import pytest

from idemproxy.http.headers import asks_the_server, host_problem, split_absolute_form, valid_host


@pytest.mark.parametrize(
    "value",
    [
        None,  # HTTP/1.0 may omit it (aiohttp refuses HTTP/1.1 without one)
        "api.example.com",
        "api.example.com:8443",
        "localhost:",  # an empty port is in RFC 3986's grammar
        "127.0.0.1:9000",
        "[::1]",
        "[2001:db8::7]:443",
        "[v1.fe80::a+en1]",  # IPvFuture
        "xn--bcher-kva.example",
        "my%2Dhost",
        "a;b=c!$&'()*+",  # a reg-name may hold sub-delims, but `,`
    ],
)
def test_valid_hosts(value: str | None) -> None:
    assert valid_host(value)


@pytest.mark.parametrize(
    "value",
    [
        "a, b",  # two values merged into one line
        "a,b",  # the same without the space: a backend may take either name
        "",  # RFC 9110 §4.2.1: an http(s) URI with an empty host is invalid
        ":8080",  # a port and no host
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


@pytest.mark.parametrize(
    ("target", "host"),
    [
        ("/x", "api.example.com"),
        ("http://api.example.com/x", "api.example.com"),
        ("HTTP://API.example.com:80/x", "api.example.com"),  # RFC 9110 §4.2.3: default port
        ("https://api.example.com/x", "api.example.com:443"),
        ("http://api.example.com./x?y", "api.example.com"),
        ("http://[::1]:8080/x", "[::1]:8080"),
        ("http://api.example.com/x", None),  # HTTP/1.0 without Host: the authority names it
    ],
)
def test_an_absolute_form_target_agreeing_with_host_is_accepted(
    target: str, host: str | None
) -> None:
    assert host_problem(host, target) is None


@pytest.mark.parametrize(
    ("target", "host"),
    [
        ("http://other.example/x", "api.example.com"),  # RFC 9112 §3.2.2 vs the backend's Host
        ("http://api.example.com:8080/x", "api.example.com"),
        ("https://api.example.com/x", "api.example.com:80"),
        ("http://user@api.example.com/x", "api.example.com"),  # RFC 9110 §4.2.4
        ("http://user:pw@api.example.com/x", "api.example.com"),
        ("ftp://api.example.com/x", "api.example.com"),
        ("http:///x", "api.example.com"),
        ("http://a,b/x", "a,b"),
    ],
)
def test_an_absolute_form_target_disagreeing_with_host_is_refused(target: str, host: str) -> None:
    assert host_problem(host, target) is not None


def test_the_origin_form_rest_of_an_absolute_form_target_is_kept_as_sent() -> None:
    assert split_absolute_form("http://h:1/x/../y;p?q=%2F") == ("http", "h:1", "/x/../y;p?q=%2F")
    assert split_absolute_form("http://h?q") == ("http", "h", "/?q")  # RFC 9112 §3.2.1
    assert split_absolute_form("/x") is None
    assert split_absolute_form("*") is None


@pytest.mark.parametrize(
    ("method", "target", "asks"),
    [
        ("OPTIONS", "*", True),
        ("OPTIONS", "http://h", True),
        ("OPTIONS", "HTTP://H:80", True),
        ("OPTIONS", "http://h#/x", True),  # the fragment is no part of the target
        ("OPTIONS", "http://h/", False),
        ("OPTIONS", "http://h?", False),  # an empty query is a query
        ("OPTIONS", "http://h?x=1", False),
        ("OPTIONS", "/", False),
        ("OPTIONS", "/*", False),
        ("GET", "*", False),
        ("GET", "http://h", False),
        ("options", "*", False),  # methods are case-sensitive (RFC 9110 §9.1)
    ],
)
def test_a_question_to_the_server_as_a_whole(method: str, target: str, asks: bool) -> None:
    """RFC 9112 §3.2.4: `OPTIONS *`, and OPTIONS to an absolute-form target of no path and no
    query, which the last proxy sends as `*`."""
    assert asks_the_server(method, target) is asks
