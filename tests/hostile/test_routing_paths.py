"""SPEC §10: a target a backend may resolve under another route is refused, not routed.

`/x/../payments/charge` and `//payments/charge` (and their percent-encoded spellings) did not
start with `/payments/`, so they went to the `/` route and passed through untracked, while a
backend that removes dot segments (RFC 3986 §5.2.4) or merges slashes ran `/payments/charge`:
a `require_key: true` route escaped. A target whose every reading stays under the route the
proxy matched is forwarded byte for byte (tests/hostile/test_target_fidelity.py). Raw sockets:
aiohttp's client would normalise the path.
"""

from __future__ import annotations

import json
from urllib.parse import unquote

import pytest

from tests.support.backend import Ledger

from .conftest import CountingStore, ListeningProxy
from .test_identity import exchange

ESCAPES = [
    "/x/../payments/charge",
    "//payments/charge",
    "/./payments/charge",
    "/x/%2e%2e/payments/charge",
    "/x/%2E%2e/payments/charge",
    "/x/..%2fpayments/charge",
    "/x%2f..%2fpayments/charge",
    "/%2fpayments/charge",
    "/x/.%2e/payments/charge",
    "/x\\..\\payments/charge",
    "/x/%5c..%5cpayments/charge",
    "http://proxy/x/../payments/charge",  # absolute-form (RFC 9112 §3.2.2)
    "http://proxy/x/%2e%2e/payments/charge",
    "http://proxy//payments/charge",
    "/x/..;/payments/charge",  # Tomcat strips `;` before it removes dot segments
    "/x%23/../payments/charge",  # a `#` decoded is no fragment: the dot segment removes it
    "/payments/charge/../../x",  # the other way: out of the governed route
    "/payments/..",
    "/x/%2e%2e%3b/payments/charge",
    "/x\\payments/../../payments/charge",
]


def post(target: str, key: bool = False) -> bytes:
    return (
        f"POST {target} HTTP/1.1\r\nHost: proxy\r\n".encode()
        + (b"Idempotency-Key: k-path\r\n" if key else b"")
        + b"Content-Length: 3\r\nConnection: close\r\n\r\npay"
    )


@pytest.fixture
async def payments_proxy(
    listening_proxy: ListeningProxy, backend_url: str, counting_store: CountingStore
) -> tuple[str, int]:
    routes = [{"prefix": "/payments", "upstream": backend_url, "require_key": True}]
    return await listening_proxy(inject_store=counting_store, routes=routes)


@pytest.mark.parametrize("target", ESCAPES)
async def test_an_ambiguous_path_is_400_and_reaches_no_backend(
    payments_proxy: tuple[str, int], counting_store: CountingStore, ledger: Ledger, target: str
) -> None:
    for key in (False, True):
        answer = await exchange(payments_proxy, post(target, key))
        assert answer.startswith(b"HTTP/1.1 400 "), (target, answer[:200])
        assert b"Idempotency-Error: path-invalid\r\n" in answer
    assert counting_store.calls == []
    assert ledger.count() == 0


async def test_the_route_itself_still_requires_its_key(
    payments_proxy: tuple[str, int], ledger: Ledger
) -> None:
    refused = await exchange(payments_proxy, post("/payments/charge"))
    assert b"Idempotency-Error: key-missing\r\n" in refused
    # Percent-encoded `/` is a separator too: this is the /payments route, not the `/` one.
    encoded = await exchange(payments_proxy, post("/payments%2Fcharge"))
    assert b"Idempotency-Error: key-missing\r\n" in encoded
    assert ledger.count() == 0
    governed = await exchange(payments_proxy, post("/payments/charge", key=True))
    assert governed.startswith(b"HTTP/1.1 201 "), governed[:200]
    assert ledger.count("k-path") == 1


@pytest.mark.parametrize("target", ["/", "/things/", "/.well-known/x", "/a..b/...", "/v1/a.b"])
async def test_dots_inside_a_segment_and_a_trailing_slash_are_fine(
    payments_proxy: tuple[str, int], target: str
) -> None:
    answer = await exchange(payments_proxy, post(target))
    assert answer.startswith(b"HTTP/1.1 201 "), (target, answer[:200])


@pytest.mark.parametrize(
    "host", ["api.example.com", "API.Example.COM", "api.example.com.", "api.example.com.:8080"]
)
async def test_a_host_route_is_found_by_any_spelling_of_its_name(
    listening_proxy: ListeningProxy,
    backend_url: str,
    counting_store: CountingStore,
    ledger: Ledger,
    host: str,
) -> None:
    """`API.example.com.` names the same host in DNS: it must not miss the host's route (and its
    `require_key`) for the route without a host."""
    routes = [
        {"prefix": "/payments", "host": "api.example.com", "upstream": backend_url,
         "require_key": True},
    ]  # fmt: skip
    address = await listening_proxy(inject_store=counting_store, routes=routes)
    request = (
        f"POST /payments/charge HTTP/1.1\r\nHost: {host}\r\n"
        "Content-Length: 3\r\nConnection: close\r\n\r\npay"
    )
    answer = await exchange(address, request.encode())
    assert b"Idempotency-Error: key-missing\r\n" in answer, answer[:200]
    assert ledger.count() == 0


# RFC 3986 §3.3 path parameters: Servlet containers (Tomcat, Jetty, Spring) strip `;params` from
# every segment before they route, so each of these runs the payments handler; matched as sent,
# each went to the `/` route and passed through untracked. So does a NUL (which ends a C string)
# before the rest of the segment, and a space or a dot that ends a segment (trimmed by Windows
# servers).
UNROUTABLE = [
    "/payments;x=1",
    "/payments;",
    "/payments;x=1/charge",
    "/payments;a/charge",
    "/payments%3b",
    "/payments%3B/charge",
    "/payments%00",
    "/payments%00x/charge",
    "/payments%20",
    "/payments%20/charge",
    "/payments./charge",
    "/payments%2e%20/charge",
    "http://proxy/payments;x=1/charge",
]


@pytest.mark.parametrize("target", UNROUTABLE)
async def test_path_parameters_and_control_characters_are_400_and_reach_no_backend(
    payments_proxy: tuple[str, int], counting_store: CountingStore, ledger: Ledger, target: str
) -> None:
    for key in (False, True):
        answer = await exchange(payments_proxy, post(target, key))
        assert answer.startswith(b"HTTP/1.1 400 "), (target, answer[:200])
        assert b"Idempotency-Error: path-invalid\r\n" in answer
    assert counting_store.calls == []
    assert ledger.count() == 0


async def test_a_path_parameter_is_refused_for_a_method_that_is_not_governed(
    payments_proxy: tuple[str, int], ledger: Ledger
) -> None:
    request = b"GET /payments;x=1/charge HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n"
    answer = await exchange(payments_proxy, request)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"Idempotency-Error: path-invalid\r\n" in answer
    assert ledger.count() == 0


async def test_a_nested_route_is_not_escaped_by_a_parameter_in_a_parent_segment(
    listening_proxy: ListeningProxy,
    backend_url: str,
    counting_store: CountingStore,
    ledger: Ledger,
) -> None:
    routes = [{"prefix": "/v1/payments", "upstream": backend_url, "require_key": True}]
    address = await listening_proxy(inject_store=counting_store, routes=routes)
    for target in ("/v1;a/payments", "/v1%3Ba/payments", "/v1/payments;x=1"):
        answer = await exchange(address, post(target))
        assert b"Idempotency-Error: path-invalid\r\n" in answer, (target, answer[:200])
    assert counting_store.calls == []
    assert ledger.count() == 0


@pytest.mark.parametrize("target", ["/things/a%20b", "/things/%20a", "/v1/a=b,c", "/v1/x%3Dy"])
async def test_a_space_inside_a_segment_and_other_sub_delims_are_fine(
    payments_proxy: tuple[str, int], target: str
) -> None:
    answer = await exchange(payments_proxy, post(target))
    assert answer.startswith(b"HTTP/1.1 201 "), (target, answer[:200])


async def test_route_prefixes_match_case_sensitively(
    payments_proxy: tuple[str, int], ledger: Ledger
) -> None:
    """RFC 3986 §6.2.2.1: the path is case-sensitive; `/Payments` is another resource, routed as
    nginx `location` prefixes are. docs/deploy.md tells operators to use the backend's case."""
    answer = await exchange(payments_proxy, post("/Payments/charge"))
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:200]
    assert ledger.count() == 1


@pytest.fixture
async def three_routes(
    listening_proxy: ListeningProxy, backend_url: str, counting_store: CountingStore
) -> tuple[str, int]:
    """`/payments` governed with `require_key: true`, `/public`, and `/` (the upstream)."""
    routes = [
        {"prefix": "/payments", "upstream": backend_url, "require_key": True},
        {"prefix": "/public", "upstream": backend_url},
    ]
    return await listening_proxy(inject_store=counting_store, routes=routes)


# A WHATWG parser (Node's `new URL(req.url).pathname`) removes dot segments from the raw path,
# where `a%2Fb` is one segment and `%2e%2e` is `..`: each of these is `/payments...` there. Read
# only once decoded (`/a/b/../payments/charge` is `/a/payments/charge`), they went to the `/`
# route and passed through untracked.
ENCODED_SLASH_ESCAPES = [
    "/a%2Fb/../payments/charge",
    "/public%2Fx/../payments/charge",
    "/x%2Fy/%2e%2e/payments",
    "/x%2fy/.%2E/payments/charge",
    "/x%5Cy/../payments/charge",
    "/public/a%2Fb/../../payments",
    "/payments/a%2Fb/../../public",  # out of the governed route
    "http://proxy/a%2Fb/../payments/charge",  # absolute-form (RFC 9112 §3.2.2)
]
# Spring's AntPathMatcher trims whitespace from each segment (trimTokens); Starlette's
# `^/payments$` matches `/payments\n` (Python's `$` matches before a final newline); a segment
# `..` followed by a space or a tab is `..` once trimmed.
BLANK_ESCAPES = [
    "/payments%0a",
    "/payments%0A/charge",
    "/payments%09",
    "/payments%0d",
    "/payments%0b",
    "/payments%7f",
    "/payments%01/charge",  # Java's String.trim() takes every character up to 0x20
    "/payments%7f/charge",
    "/payments%09;x=1",
    "/%09payments",
    "/%20payments/charge",
    "/public/..%09/payments",
    "/public/..%20/payments",
    "/public/%20../payments",
    "/x%2Fy/..%09/payments",
]


@pytest.mark.parametrize("target", ENCODED_SLASH_ESCAPES + BLANK_ESCAPES)
async def test_an_encoded_slash_or_a_blank_at_a_route_boundary_is_400(
    three_routes: tuple[str, int], counting_store: CountingStore, ledger: Ledger, target: str
) -> None:
    for key in (False, True):
        answer = await exchange(three_routes, post(target, key))
        assert answer.startswith(b"HTTP/1.1 400 "), (target, answer[:200])
        assert b"Idempotency-Error: path-invalid\r\n" in answer
    assert counting_store.calls == []
    assert ledger.count() == 0


@pytest.mark.parametrize(
    "target",
    [
        "/public/a%2Fb/../c",  # /public/c either way
        "/public/a%2Fb",
        "/x%2Fy/../z",
        "/public/my%20file%20/z.txt",
        "/public/a;b.txt",
        "/public/a%09b",  # a tab inside a segment is trimmed by no one
        "/things/..%09/x",
    ],
)
async def test_an_encoded_slash_or_a_blank_that_stays_in_its_route_is_forwarded(
    three_routes: tuple[str, int], ledger: Ledger, target: str
) -> None:
    answer = await exchange(three_routes, post(target))
    assert answer.startswith(b"HTTP/1.1 201 "), (target, answer[:200])
    assert ledger.count() == 1


# RFC 3986 §4.2: a path that starts with two separators is a network-path reference to a backend
# that parses it alone (Python's `urlsplit(path).path`, PHP's `parse_url`, Java's
# `URI.getPath()`, Go's `url.Parse`, Node's `new URL(req.url, base).pathname`): `//evil` is an
# authority and `/payments` the path it runs. WHATWG takes `\` for `/` and skips every leading
# separator (`///evil/payments` has the host `evil`). Matched as sent, each went to the `/` route
# and passed through untracked.
AUTHORITY_ESCAPES = [
    "//evil/payments",
    "//evil/payments/charge",
    "http://proxy//evil/payments",  # absolute-form (RFC 9112 §3.2.2)
    "//evil/public/../payments",
    "//x@y/payments/charge",
    "/\\evil/payments/refund",
    "///evil/payments",
    "//evil:443/payments",
    "/%2F/evil/payments",  # read once decoded
]


@pytest.mark.parametrize("target", AUTHORITY_ESCAPES)
async def test_a_leading_authority_before_another_route_is_400(
    three_routes: tuple[str, int], counting_store: CountingStore, ledger: Ledger, target: str
) -> None:
    for key in (False, True):
        answer = await exchange(three_routes, post(target, key))
        assert answer.startswith(b"HTTP/1.1 400 "), (target, answer[:200])
        assert b"Idempotency-Error: path-invalid\r\n" in answer
    assert counting_store.calls == []
    assert ledger.count() == 0


@pytest.mark.parametrize("target", ["//evil/payments", "///evil/payments", "/\\evil/payments"])
async def test_a_leading_authority_before_another_route_is_400_with_two_routes(
    payments_proxy: tuple[str, int], ledger: Ledger, target: str
) -> None:
    answer = await exchange(payments_proxy, post(target))
    assert b"Idempotency-Error: path-invalid\r\n" in answer, (target, answer[:200])
    assert ledger.count() == 0


@pytest.mark.parametrize(
    "target",
    [
        "//evil/things",  # `/things` is the `/` route too
        "//cdn.example/images/a.png",
        "/\\evil/things",
    ],
)
async def test_a_leading_authority_that_stays_in_its_route_is_forwarded(
    three_routes: tuple[str, int], ledger: Ledger, target: str
) -> None:
    answer = await exchange(three_routes, post(target))
    assert answer.startswith(b"HTTP/1.1 201 "), (target, answer[:200])
    assert ledger.count() == 1


@pytest.mark.parametrize("target", [*AUTHORITY_ESCAPES, "/bucket/logs//2026.txt"])
async def test_one_route_forwards_a_leading_authority_as_sent(
    listening_proxy: ListeningProxy, counting_store: CountingStore, ledger: Ledger, target: str
) -> None:
    """With the one `/` route every reading is that route: nothing to refuse (SPEC §10)."""
    address = await listening_proxy(inject_store=counting_store)
    answer = await exchange(address, post(target))
    assert answer.startswith(b"HTTP/1.1 201 "), (target, answer[:200])
    assert ledger.count() == 1
    # The backend's own reading of the path (aiohttp: `//evil` stays in the path).
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["path"] == unquote(
        target.removeprefix("http://proxy")
    )
