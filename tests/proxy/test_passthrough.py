"""SPEC §2.5, §10: what crosses the proxy, in both directions, governed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from yarl import URL

from tests.support.backend import Ledger
from tests.support.proxychecks import KEY, REPLAYED, raw_exchange

from .conftest import ProxyFactory, RawUpstream

HOP_BY_HOP = ("Connection", "Keep-Alive", "TE", "Upgrade", "Proxy-Authorization", "X-Secret")
GOVERNED_OR_NOT = pytest.mark.parametrize(
    ("method", "extra"), [("GET", {}), ("POST", {KEY: "k"})], ids=["passthrough", "governed"]
)


@GOVERNED_OR_NOT
async def test_hop_by_hop_request_headers_are_not_forwarded(
    proxy: ProxyFactory, ledger: Ledger, method: str, extra: dict[str, str]
) -> None:
    client = await proxy()
    request = (
        f"{method} /things HTTP/1.1\r\nHost: shop.example\r\n"
        "Connection: close, X-Secret\r\nX-Secret: s3cret\r\nKeep-Alive: timeout=5\r\n"
        "TE: trailers\r\nUpgrade: h2c\r\nProxy-Authorization: Basic YTpi\r\n"
        "Authorization: Bearer end-to-end\r\nX-Kept: yes\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in extra.items())
        + "Content-Length: 0\r\n\r\n"
    ).encode()
    status, _, _ = await raw_exchange(client, request)
    assert status == 201
    [execution] = ledger.executions
    received = {name.lower() for name, _ in execution.headers}
    assert not received & {name.lower() for name in HOP_BY_HOP}
    assert execution.header("X-Kept") == "yes"
    assert execution.header("Authorization") == "Bearer end-to-end"


@GOVERNED_OR_NOT
async def test_hop_by_hop_response_headers_are_not_passed_back_or_replayed(
    proxy: ProxyFactory, raw_upstream: RawUpstream, method: str, extra: dict[str, str]
) -> None:
    raw_upstream.response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
        b"Connection: close, X-Secret\r\nX-Secret: s3cret\r\nKeep-Alive: timeout=5\r\n"
        b"Proxy-Authenticate: Basic\r\nUpgrade: h2c\r\nX-Kept: yes\r\n\r\nok"
    )
    client = await proxy(upstream=raw_upstream.url)
    for _ in range(2):  # governed: the second answer is the replay
        async with client.request(method, "/things", headers=extra) as response:
            assert response.status == 200
            assert await response.read() == b"ok"
            assert response.headers["X-Kept"] == "yes"
            for name in ("X-Secret", "Keep-Alive", "Proxy-Authenticate", "Upgrade"):
                assert name not in response.headers
            assert response.headers.get("Connection", "keep-alive") == "keep-alive"
    assert len(raw_upstream.heads) == (2 if method == "GET" else 1)


@GOVERNED_OR_NOT
async def test_x_forwarded_headers_are_added(
    proxy: ProxyFactory, ledger: Ledger, method: str, extra: dict[str, str]
) -> None:
    client = await proxy(trusted_proxies=["127.0.0.0/8"])  # what a client claims is believed
    headers = {"X-Forwarded-For": "203.0.113.7", **extra}
    async with client.request(method, "/things", headers=headers) as response:
        assert response.status == 201
    [execution] = ledger.executions
    assert execution.header("X-Forwarded-For") == "203.0.113.7, 127.0.0.1"
    assert execution.header("X-Forwarded-Proto") == "http"
    assert execution.header("X-Forwarded-Host") == f"{client.host}:{client.port}"


@GOVERNED_OR_NOT
async def test_path_and_query_reach_the_upstream_byte_for_byte(
    proxy: ProxyFactory, raw_upstream: RawUpstream, method: str, extra: dict[str, str]
) -> None:
    client = await proxy(upstream=raw_upstream.url)
    target = "/a%2Fb/.x%2fy/c?b=2&a=1&a=%2F&t=%7e&sp=a+b&e=&flag&u=%C3%A9&v=%2f%20;x&w=/../"
    async with client.request(method, URL(target, encoded=True), headers=extra) as response:
        assert response.status == 200
    [head] = raw_upstream.heads
    assert head.split(b"\r\n", 1)[0] == f"{method} {target} HTTP/1.1".encode()


@GOVERNED_OR_NOT
async def test_repeated_request_headers_keep_their_values_and_order(
    proxy: ProxyFactory, ledger: Ledger, method: str, extra: dict[str, str]
) -> None:
    client = await proxy()
    headers = [("X-Multi", "1"), ("Accept", "a/b"), ("X-Multi", "2"), ("X-Multi", "3")]
    async with client.request(method, "/things", headers=headers + list(extra.items())) as r:
        assert r.status == 201
    [execution] = ledger.executions
    assert [v for k, v in execution.headers if k.lower() == "x-multi"] == ["1", "2", "3"]


async def test_streamed_request_body_of_a_non_governed_method_arrives_intact(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    parts = [bytes([i]) * (1000 + i) for i in range(50)]

    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async with client.put("/files/1", data=body(), headers={KEY: "ignored"}) as response:
        assert response.status == 201
    [execution] = ledger.executions
    assert execution.body == b"".join(parts)
    assert execution.header("Transfer-Encoding") == "chunked"  # streamed, not buffered
    assert execution.header("Content-Length") is None


async def test_streamed_chunked_response_arrives_intact(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    async with client.get("/export?size=300000&chunked=1") as response:
        assert response.status == 201
        assert response.headers.get("Transfer-Encoding") == "chunked"
        assert await response.read() == bytes(i % 251 for i in range(300000))
        assert REPLAYED not in response.headers
    assert ledger.count() == 1
