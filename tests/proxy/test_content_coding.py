"""Content codings pass through untouched (RFC 9110 §8.4: the coding is between the client and
the backend). aiohttp's server decompressed a gzip request body by default, and the proxy sent
the plain bytes on, still labelled gzip: the backend got a body it could not decode."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from .conftest import ProxyFactory


class CodedUpstream:
    """An upstream that keeps each request body exactly as it arrived."""

    def __init__(self) -> None:
        self.received: list[tuple[bytes, str | None]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append((await request.read(), request.headers.get("Content-Encoding")))
        return web.Response(status=201, text="{}", content_type="application/json")


@pytest.fixture
async def coded_upstream() -> AsyncIterator[tuple[CodedUpstream, str]]:
    upstream = CodedUpstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", upstream.handle)
    runner = web.AppRunner(app, auto_decompress=False)  # its own server must not decode either
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield upstream, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("key", [None, "coded-1"], ids=["pass-through", "governed"])
async def test_a_gzip_request_body_goes_upstream_as_it_came(
    proxy: ProxyFactory, coded_upstream: tuple[CodedUpstream, str], key: str | None
) -> None:
    upstream, url = coded_upstream
    client = await proxy(upstream=url)
    coded = gzip.compress(b'{"amount": 1250}', mtime=0)
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    response = await client.post("/orders", data=coded, headers=headers)
    assert response.status == 201
    assert upstream.received == [(coded, "gzip")]


async def test_a_coded_body_is_fingerprinted_as_its_coded_bytes(
    proxy: ProxyFactory, coded_upstream: tuple[CodedUpstream, str]
) -> None:
    """The proxy does not decode it: the same bytes replay, the same JSON coded differently
    is another payload (docs/reliability.md)."""
    upstream, url = coded_upstream
    client = await proxy(upstream=url)
    document = b'{"amount": 1250}'
    fast, best = gzip.compress(document, 1, mtime=0), gzip.compress(document, 9, mtime=0)
    assert fast != best
    headers = {
        "Content-Encoding": "gzip",
        "Content-Type": "application/json",
        "Idempotency-Key": "coded-twice",
    }
    first = await client.post("/orders", data=fast, headers=headers)
    again = await client.post("/orders", data=fast, headers=headers)
    other = await client.post("/orders", data=best, headers=headers)
    assert (first.status, again.status, other.status) == (201, 201, 409)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert upstream.received == [(fast, "gzip")]
