"""SPEC §10: the request target reaches the backend byte for byte, no normalisation and no
re-encoding, and is refused only where a backend may read it under another route.

S3 object keys such as `a;b.txt`, `logs//2026.txt` or `x/../y.txt` were `400 path-invalid`
though S3 accepts them; with one route there is nothing to escape. The upstream here records the
bytes it received (tests/support/recording_upstream.py); the client writes raw bytes, since
aiohttp's client would normalise the path.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.support.recording_upstream import RecordingUpstream

from .conftest import CountingStore, ListeningProxy
from .test_identity import exchange


@pytest.fixture
async def recorder() -> AsyncIterator[RecordingUpstream]:
    async with RecordingUpstream() as upstream:
        yield upstream


def request(method: str, target: str, key: str | None = None) -> bytes:
    return (
        f"{method} {target} HTTP/1.1\r\nHost: proxy\r\n".encode()
        + (f"Idempotency-Key: {key}\r\n".encode() if key else b"")
        + b"Content-Length: 3\r\nConnection: close\r\n\r\npay"
    )


# S3 object keys the issue names, and other targets a normalising proxy would change.
ONE_ROUTE_TARGETS = [
    "/bucket/a;b.txt",
    "/bucket/logs//2026.txt",
    "/bucket/x/../y.txt",
    "/bucket/./rel.txt",
    "/bucket/my%20file%20/z.txt",
    "/bucket/%2e%2e/%2E/a%2Fb%5Cc%3B",
    "/bucket/x%00y%01%7f%09",
    "/%7e/~/%7E?x=%2F&y=/../&z=%20+",
    "//double/leading",
    "/a/b/..",
    "/..",
    "/bucket/key%ZZ%",
    "/bucket/a%23b.txt",
    # An empty query: a URL holds none, the target keeps its `?`.
    "/bucket/empty?",
    "/?",
    "/bucket/q?a=1?",
]


@pytest.mark.parametrize("target", ONE_ROUTE_TARGETS)
async def test_with_one_route_every_target_goes_upstream_byte_for_byte(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    target: str,
) -> None:
    address = await listening_proxy(inject_store=counting_store, upstream=recorder.url)
    for method, key in (("GET", None), ("PUT", None), ("POST", f"k-{target}")):
        answer = await exchange(address, request(method, target, key))
        assert answer.startswith(b"HTTP/1.1 201 "), (method, target, answer[:300])
    assert [r.target for r in recorder.received] == [target.encode()] * 3
    assert [r.body for r in recorder.received] == [b"pay"] * 3


@pytest.fixture
async def payments_and_rest(
    listening_proxy: ListeningProxy, counting_store: CountingStore, recorder: RecordingUpstream
) -> tuple[str, int]:
    routes = [{"prefix": "/payments", "upstream": recorder.url, "require_key": True}]
    return await listening_proxy(inject_store=counting_store, upstream=recorder.url, routes=routes)


# Refused before: each stays under the route the proxy matched, whatever a backend resolves.
SAME_ROUTE_TARGETS = [
    "/payments//charge",
    "/payments/charge;jsessionid=1",
    "/payments/charge%3bx=1",
    "/payments/charge%00.json",
    "/payments/charge%09",
    "/payments/charge%20",
    "/payments/a/../charge",
    "/payments/./charge",
]


@pytest.mark.parametrize("target", SAME_ROUTE_TARGETS)
async def test_a_target_that_stays_under_its_route_is_governed_and_forwarded_untouched(
    payments_and_rest: tuple[str, int], recorder: RecordingUpstream, target: str
) -> None:
    refused = await exchange(payments_and_rest, request("POST", target))
    assert b"Idempotency-Error: key-missing\r\n" in refused, (target, refused[:300])
    answer = await exchange(payments_and_rest, request("POST", target, "k-same"))
    assert answer.startswith(b"HTTP/1.1 201 "), (target, answer[:300])
    assert recorder.one.target == target.encode()
    assert recorder.one.header_lines("Idempotency-Key") == [b"k-same"]


# Under the `/` route in every reading: untracked, as the `/` route is, and untouched.
OTHER_ROUTE_TARGETS = [
    "/things//x",
    "/things/x/../y",
    "/things;x/y",
    # A control character inside a segment is trimmed by no server (at its end, Spring's
    # trimTokens would: /payments%01/charge is refused, tests/hostile/test_routing_paths.py).
    "/payments%01x/charge",
    "/payments%7fx/charge",
    "/paymentsx/../things",
]


@pytest.mark.parametrize("target", OTHER_ROUTE_TARGETS)
async def test_a_target_that_stays_under_the_catch_all_is_passed_through_untouched(
    payments_and_rest: tuple[str, int], recorder: RecordingUpstream, target: str
) -> None:
    answer = await exchange(payments_and_rest, request("POST", target))
    assert answer.startswith(b"HTTP/1.1 201 "), (target, answer[:300])
    assert recorder.one.target == target.encode()


async def test_an_absolute_form_target_goes_on_in_origin_form_as_sent(
    listening_proxy: ListeningProxy, counting_store: CountingStore, recorder: RecordingUpstream
) -> None:
    """RFC 9112 §3.2.2: its path and query as sent, not yarl's normalised path."""
    address = await listening_proxy(inject_store=counting_store, upstream=recorder.url)
    for target, sent in (
        ("http://proxy/x/../y;p/%2e%2e?q=%2F&r=/./", b"/x/../y;p/%2e%2e?q=%2F&r=/./"),
        ("HTTP://PROXY:80/a//b", b"/a//b"),
        ("http://proxy/p?", b"/p?"),
        ("http://proxy?", b"/?"),
        ("http://proxy?a=1", b"/?a=1"),
    ):
        for method, key in (("POST", "k-" + target), ("GET", None)):  # governed, pass-through
            answer = await exchange(address, request(method, target, key))
            assert answer.startswith(b"HTTP/1.1 201 "), (target, answer[:300])
            assert recorder.received[-1].target == sent


@pytest.mark.parametrize(
    ("target", "sent"),
    [
        ("/public#/../payments/charge", b"/public"),
        ("/a?b=c#/../d", b"/a?b=c"),
        ("/p#f?", b"/p"),  # a `?` in the fragment is no query
        ("/p?#f", b"/p?"),  # an empty query before it is
    ],
)
async def test_a_fragment_is_not_forwarded(
    payments_and_rest: tuple[str, int], recorder: RecordingUpstream, target: str, sent: bytes
) -> None:
    """RFC 9112 §3.2 allows no fragment in a request target; aiohttp's parser accepts one and
    routes without it. Forwarded, a backend that keeps `#` in the path (Go's net/http) would
    resolve `/public#/../payments/charge` to the governed route: the backend gets what was
    routed, the target without its fragment."""
    answer = await exchange(payments_and_rest, request("POST", target))
    assert answer.startswith(b"HTTP/1.1 201 "), (target, answer[:300])
    assert recorder.one.target == sent


@pytest.mark.parametrize("methods", [None, ["POST", "OPTIONS"]], ids=["default", "governed"])
@pytest.mark.parametrize("base", ["", "/base"])
async def test_options_asterisk_asks_the_upstream_as_a_whole(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    methods: list[str] | None,
    base: str,
) -> None:
    """RFC 9112 §3.2.4: `OPTIONS *` is a question to the server, not to one of its resources:
    it goes upstream as `*` (an upstream URL's path is no part of it), untracked even where
    OPTIONS is governed (it names no resource, so no intent), and its answer comes back. It
    was the router's `404` before."""
    settings: dict[str, Any] = {} if methods is None else {"methods": methods}
    address = await listening_proxy(
        inject_store=counting_store, upstream=recorder.url + base, **settings
    )
    answer = await exchange(address, request("OPTIONS", "*", "k-asterisk"))
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    assert recorder.one.head.split(b"\r\n", 1)[0] == b"OPTIONS * HTTP/1.1"
    assert recorder.one.header_lines("Idempotency-Key") == [b"k-asterisk"]
    assert recorder.one.body == b"pay"
    assert counting_store.calls == []


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_an_asterisk_with_another_method_is_refused(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    method: str,
) -> None:
    """Only OPTIONS takes the asterisk-form (RFC 9112 §3.2.4): any other method's is never
    forwarded: the parser's `400`, or the listener's `404` where an older parser takes it."""
    address = await listening_proxy(inject_store=counting_store, upstream=recorder.url)
    answer = await exchange(address, request(method, "*", "k-star"))
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] in (b"400", b"404"), answer[:300]
    assert recorder.received == []
    assert counting_store.calls == []


async def test_options_asterisk_with_100_continue_is_invited_where_options_is_governed(
    listening_proxy: ListeningProxy, counting_store: CountingStore, recorder: RecordingUpstream
) -> None:
    """Not governed, so not refused from its head (no key on a route that requires one)."""
    address = await listening_proxy(
        inject_store=counting_store,
        upstream=recorder.url,
        methods=["POST", "OPTIONS"],
        require_key=True,
    )
    head = b"OPTIONS * HTTP/1.1\r\nHost: proxy\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(head)
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"pay")
        final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert final.startswith(b"HTTP/1.1 201 "), final
    finally:
        writer.close()
    assert recorder.one.body == b"pay"
    assert counting_store.calls == []


@pytest.mark.parametrize(
    ("target", "sent"),
    [
        ("http://proxy", b"*"),
        ("HTTP://PROXY:80", b"*"),
        ("http://proxy/", b"/"),
        ("http://proxy?x=1", b"/?x=1"),
    ],
)
async def test_options_to_an_absolute_form_without_path_or_query_asks_the_server(
    listening_proxy: ListeningProxy,
    counting_store: CountingStore,
    recorder: RecordingUpstream,
    target: str,
    sent: bytes,
) -> None:
    """RFC 9112 §3.2.4: the last proxy sends `OPTIONS http://host` (no path, no query) as
    `OPTIONS *`; with a path or a query it names a resource, sent in origin-form."""
    address = await listening_proxy(
        inject_store=counting_store, upstream=recorder.url + "/base", methods=["POST", "OPTIONS"]
    )
    answer = await exchange(address, request("OPTIONS", target))
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    assert recorder.one.target == (sent if sent == b"*" else b"/base" + sent)
