"""SPEC §4.1: a route's key from another header or from a JSON Pointer into the body."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from typing import Any

import pytest

from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient
from tests.support.proxychecks import KEY, REPLAYED, assert_problem, raw_exchange

from .conftest import ProxyFactory

SHOPIFY_ID = "X-Shopify-Webhook-Id"


async def orders(proxy: ProxyFactory, backend_url: str, **route: Any) -> ProxyClient:
    key = {"pointer": "/order_id", "prefix": "order:"}
    return await proxy(routes=[{"prefix": "/orders", "upstream": backend_url, "key": key, **route}])


def order(order_id: object, amount: int = 10) -> bytes:
    return json.dumps({"order_id": order_id, "amount": amount}).encode()


async def post(client: ProxyClient, path: str, body: bytes, **headers: str) -> tuple[int, bool]:
    sent = {"Content-Type": "application/json", **headers}
    async with client.post(path, data=body, headers=sent) as response:
        await response.read()
        return response.status, REPLAYED in response.headers


async def test_the_key_comes_from_the_body_with_its_prefix(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    client = await orders(proxy, backend_url)
    assert await post(client, "/orders", order("A-1")) == (201, False)
    # The same JSON in another layout is the same payload (SPEC §6), so a replay.
    assert await post(client, "/orders", b'{ "amount":10,"order_id":"A-1" }') == (201, True)
    assert ledger.count() == 1
    [job] = await jobs.list_jobs()
    assert (job.owner, job.key) == ("anonymous", "order:A-1")


async def test_the_fingerprint_still_tells_payloads_apart(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger
) -> None:
    client = await orders(proxy, backend_url)
    assert (await post(client, "/orders", order("A-2", amount=10)))[0] == 201
    async with client.post(
        "/orders", data=order("A-2", amount=11), headers={"Content-Type": "application/json"}
    ) as response:
        await assert_problem(response, "payload-mismatch", 409)
    assert ledger.count() == 1


async def test_an_absent_or_invalid_body_key_passes_through_unless_required(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    client = await orders(proxy, backend_url)
    for body in (b'{"amount": 1}', order(True), b"not json", order("has space")):
        for _ in range(2):
            assert await post(client, "/orders", body) == (201, False)
    assert ledger.count() == 8
    assert await jobs.list_jobs() == []
    strict = await orders(proxy, backend_url, require_key=True)
    async with strict.post("/orders", data=b'{"amount": 1}') as response:
        await assert_problem(response, "key-missing", 400)
    async with strict.post("/orders", data=order(True)) as response:
        await assert_problem(response, "key-invalid", 400)
    assert ledger.count() == 8
    assert await jobs.list_jobs() == []


async def test_the_idempotency_key_header_is_not_the_key_on_a_body_keyed_route(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    client = await orders(proxy, backend_url)
    assert (await post(client, "/orders", order("B-1"), **{KEY: "one"}))[0] == 201
    assert await post(client, "/orders", order("B-1"), **{KEY: "two"}) == (201, True)
    assert ledger.count() == 1
    assert [j.key for j in await jobs.list_jobs()] == ["order:B-1"]


async def test_the_key_comes_from_a_named_header(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(
        routes=[
            {
                "prefix": "/shopify",
                "upstream": backend_url,
                "key": {"header": "X-Shopify-Webhook-Id"},
            }
        ]
    )
    for _ in range(2):
        await post(client, "/shopify", b"{}", **{SHOPIFY_ID: "b54557e4"})
    assert await post(client, "/shopify", b"{}") == (201, False)  # no key: through, untracked
    async with client.post(
        "/shopify",
        data=b"{}",
        headers={"X-Shopify-Webhook-Id": "x", "Connection": "X-Shopify-Webhook-Id"},
    ) as response:
        await assert_problem(response, "header-invalid", 400)
    assert ledger.count() == 2
    assert [j.key for j in await jobs.list_jobs()] == ["b54557e4"]


async def test_a_prefix_alone_keeps_the_key_header(
    proxy: ProxyFactory, backend_url: str, jobs: Store
) -> None:
    client = await proxy(
        routes=[{"prefix": "/v2", "upstream": backend_url, "key": {"prefix": "v2:"}}]
    )
    await post(client, "/v2/pay", b"{}", **{KEY: "k1"})
    await post(client, "/v1/pay", b"{}", **{KEY: "k1"})  # the default route: no prefix
    assert sorted(j.key for j in await jobs.list_jobs()) == ["k1", "v2:k1"]


async def test_a_body_larger_than_the_spool_threshold_still_names_its_key(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(
        server={"spool_threshold": 1024},
        routes=[
            {
                "prefix": "/orders",
                "upstream": backend_url,
                "key": {"pointer": "/order_id", "prefix": "order:"},
            }
        ],
    )
    body = json.dumps({"order_id": "L-1", "lines": ["x" * 100] * 100}).encode()
    assert await post(client, "/orders", body) == (201, False)
    assert await post(client, "/orders", body) == (201, True)
    assert ledger.count() == 1
    assert [j.key for j in await jobs.list_jobs()] == ["order:L-1"]


def hiding_authorization(body: bytes) -> bytes:
    return (
        b"POST /orders HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer alice\r\n"
        b"Content-Type: application/json\r\nConnection: close, Authorization\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


async def test_an_owner_header_named_in_connection_is_refused_on_a_body_keyed_route(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """SPEC §5: the job would be scoped by the Authorization the backend never sees."""
    client = await orders(proxy, backend_url)
    status, headers, _ = await raw_exchange(client, hiding_authorization(order("A-1")))
    assert (status, ("Idempotency-Error", "header-invalid") in headers) == (400, True)
    # Without a key in the body the request is not governed, and goes through as it would
    # on a route keyed by Idempotency-Key without the header.
    assert (await raw_exchange(client, hiding_authorization(b'{"amount": 1}')))[0] == 201
    assert ledger.count() == 1
    assert ledger.executions[0].header("Authorization") is None
    assert await jobs.list_jobs() == []


@pytest.mark.parametrize(
    "body",
    [
        # RFC 8259 §6 sets no limit on digits; Python's int() stops at 4300 by default.
        b'{"n": %s, "order_id": "A-3"}' % (b"9" * 5000),
        b'{"order_id": "A-3", "n": -%s}' % (b"1" * 4301),
    ],
    ids=["5000-digits", "negative-4301-digits"],
)
async def test_a_huge_integer_elsewhere_in_the_body_does_not_hide_the_key(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store, body: bytes
) -> None:
    client = await orders(proxy, backend_url)
    assert await post(client, "/orders", body) == (201, False)
    assert await post(client, "/orders", body) == (201, True)
    assert ledger.count() == 1
    assert [j.key for j in await jobs.list_jobs()] == ["order:A-3"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"order_id": "N-1", "amount": NaN}',
        b'{"order_id": "N-1", "amount": -Infinity}',
        '{"order_id": "N-1"}'.encode("utf-16"),
        '{"order_id": "N-1"}'.encode("utf-16-le"),
        '{"order_id": "N-1"}'.encode("utf-32-be"),
        b'\xef\xbb\xbf{"order_id": "N-1"}',  # RFC 8259 §8.1: no byte order mark
    ],
    ids=["nan", "infinity", "utf-16-bom", "utf-16-le", "utf-32-be", "utf-8-bom"],
)
async def test_a_body_that_is_not_rfc_8259_json_names_no_key(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store, body: bytes
) -> None:
    client = await orders(proxy, backend_url)
    for _ in range(2):
        assert await post(client, "/orders", body) == (201, False)
    assert ledger.count() == 2
    assert await jobs.list_jobs() == []
    strict = await orders(proxy, backend_url, require_key=True)
    async with strict.post("/orders", data=body) as response:
        await assert_problem(response, "key-missing", 400)
    assert ledger.count() == 2


async def test_array_indexes_are_ascii_digits_only(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """RFC 6901 §4: `²` and `१` are digits to Python, no array index: a member name only."""
    routes = [
        {"prefix": "/sup", "upstream": backend_url, "key": {"pointer": "/items/\u00b2/id"}},
        {"prefix": "/deva", "upstream": backend_url, "key": {"pointer": "/items/\u0967"}},
    ]
    client = await proxy(routes=routes)
    array = b'{"items": [{"id": "zero"}, {"id": "one"}, {"id": "two"}]}'
    assert await post(client, "/sup", array) == (201, False)
    assert await post(client, "/deva", b'{"items": ["zero", "one"]}') == (201, False)
    assert await jobs.list_jobs() == []
    named = '{"items": {"\u00b2": {"id": "sq"}}}'.encode()
    assert await post(client, "/sup", named) == (201, False)
    assert await post(client, "/sup", named) == (201, True)
    assert ledger.count() == 3
    assert [j.key for j in await jobs.list_jobs()] == ["sq"]


async def first_status_line(client: ProxyClient, head: bytes) -> bytes:
    """What the proxy answers to a request head that expects 100-continue, no body sent."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)
    finally:
        writer.close()


def expecting(path: str, *lines: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: proxy\r\n%sContent-Length: 1000000\r\n"
        b"Expect: 100-continue\r\n\r\n" % (path.encode(), b"".join(x + b"\r\n" for x in lines))
    )


async def test_expect_continue_is_413_at_once_where_the_body_is_read_bounded(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """RFC 9110 §10.1.1, SPEC §9: a body-keyed route reads every governed body up to
    max_request_body, whatever the headers; a header-keyed one only with its header."""
    routes = [
        {"prefix": "/orders", "upstream": backend_url, "key": {"pointer": "/order_id"}},
        {"prefix": "/shopify", "upstream": backend_url, "key": {"header": SHOPIFY_ID}},
    ]
    client = await proxy(max_request_body=100, routes=routes)
    refused = [
        expecting("/orders"),
        expecting("/shopify", SHOPIFY_ID.encode() + b": b54557e4"),
        expecting("/anything", KEY.encode() + b": k"),
    ]
    for head in refused:
        assert (await first_status_line(client, head)).startswith(b"HTTP/1.1 413 ")
    invited = [expecting("/shopify", KEY.encode() + b": k"), expecting("/anything")]
    for head in invited:
        assert await first_status_line(client, head) == b"HTTP/1.1 100 Continue\r\n"
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []


async def test_a_header_keyed_route_passes_a_large_keyless_body_through(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """SPEC §9: max_request_body bounds governed bodies; without its key header the request
    is not governed, as on a route keyed by Idempotency-Key."""
    route = {"prefix": "/shopify", "upstream": backend_url, "key": {"header": SHOPIFY_ID}}
    client = await proxy(max_request_body=100, routes=[route])
    large = b"x" * 1000
    assert await post(client, "/shopify", large) == (201, False)
    async with client.post("/shopify", data=large, headers={SHOPIFY_ID: "big"}) as response:
        await assert_problem(response, "body-too-large", 413)
    assert [e.body for e in ledger.executions] == [large]
    assert await jobs.list_jobs() == []


async def test_a_coded_body_gives_its_key_and_is_forwarded_as_sent(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """SPEC §4.1: a gzip or deflate body names its key like any other, so a redelivery with
    the same bytes is a replay, never a second execution; the backend gets the coded bytes."""
    client = await orders(proxy, backend_url)
    coded = {"gzip": gzip.compress(order("Z-1"), mtime=0), "deflate": zlib.compress(order("Z-2"))}
    for coding, body in coded.items():
        for replayed in (False, True):
            assert await post(client, "/orders", body, **{"Content-Encoding": coding}) == (
                201,
                replayed,
            )
    assert ledger.count() == 2
    assert sorted(job.key for job in await jobs.list_jobs()) == ["order:Z-1", "order:Z-2"]


@pytest.mark.parametrize("require_key", [False, True])
async def test_a_body_whose_coding_cannot_be_undone_is_refused_not_passed_through(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store, require_key: bool
) -> None:
    """SPEC §4.1: the key of a body the proxy cannot decode may name an intent that already
    ran: 415, nothing claimed or forwarded, whatever `require_key` says."""
    client = await orders(proxy, backend_url, require_key=require_key)
    refused = [
        ("br", b"\x1b\x03\x00\xf8\x25"),
        ("gzip", b"not gzip at all"),
        ("gzip, zstd", gzip.compress(order("Z-3"))),
    ]
    for coding, body in refused:
        headers = {"Content-Type": "application/json", "Content-Encoding": coding}
        async with client.post("/orders", data=body, headers=headers) as response:
            await assert_problem(response, "body-encoding-unsupported", 415)
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []
