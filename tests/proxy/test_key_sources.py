"""SPEC §4.1: a route's key from another header or from a JSON Pointer into the body."""

from __future__ import annotations

import json
from typing import Any

from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient
from tests.support.proxychecks import KEY, REPLAYED, assert_problem

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
