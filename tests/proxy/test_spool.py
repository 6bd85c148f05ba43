"""Large governed bodies wait on disk, not in memory (SPEC §9), and behave like any other."""

from __future__ import annotations

import hashlib
import io
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from idemproxy.config.settings import load_settings
from idemproxy.proxy.app import create_app

MiB = 1024 * 1024
RECEIVED = web.AppKey("received", list)


async def _digest_of_body(request: web.Request) -> web.Response:
    body = await request.read()
    request.app[RECEIVED].append(body)
    return web.json_response({"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)})


@pytest.fixture
async def upstream() -> AsyncIterator[TestServer]:
    app = web.Application(client_max_size=64 * MiB)
    app[RECEIVED] = []
    app.router.add_post("/{tail:.*}", _digest_of_body)
    server = TestServer(app)
    async with server:
        yield server


@pytest.fixture
async def client(
    upstream: TestServer, sqlite_dsn: str
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    settings = load_settings(
        upstream=str(upstream.make_url("")).rstrip("/"),
        store=sqlite_dsn,
        server={"spool_threshold": MiB},
        max_request_body=16 * MiB,
    )
    async with TestClient(TestServer(create_app(settings))) as test_client:
        yield test_client


def _big(seed: int) -> bytes:
    return bytes((i * seed) % 251 for i in range(3 * MiB + 17))


async def _chunked(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), 100_000):
        yield body[start : start + 100_000]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_spooled_body_reaches_the_upstream_intact_and_replays(
    client: TestClient[web.Request, web.Application], upstream: TestServer, chunked: bool
) -> None:
    body = _big(7)
    headers = {"Idempotency-Key": "big", "Content-Type": "application/octet-stream"}
    data = _chunked(body) if chunked else io.BytesIO(body)  # the client warns on raw bytes
    first = await client.post("/upload", data=data, headers=headers)
    assert first.status == 200
    assert await first.json() == {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    again = await client.post("/upload", data=_chunked(body), headers=headers)
    assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert upstream.app[RECEIVED] == [body]


async def test_another_large_body_under_the_same_key_is_a_mismatch(
    client: TestClient[web.Request, web.Application], upstream: TestServer
) -> None:
    headers = {"Idempotency-Key": "big2", "Content-Type": "application/octet-stream"}
    assert (await client.post("/upload", data=io.BytesIO(_big(7)), headers=headers)).status == 200
    other = await client.post("/upload", data=io.BytesIO(_big(11)), headers=headers)
    assert other.status == 409 and other.headers["Idempotency-Error"] == "payload-mismatch"
    assert len(upstream.app[RECEIVED]) == 1


async def test_spooled_json_is_matched_by_its_bytes(
    client: TestClient[web.Request, web.Application], upstream: TestServer
) -> None:
    """Above the spool threshold JSON is not canonicalised: reordering is another intent."""
    items = ",".join(f'"k{i}": {i}' for i in range(150_000))
    reordered = ",".join(f'"k{i}": {i}' for i in reversed(range(150_000)))
    headers = {"Idempotency-Key": "json", "Content-Type": "application/json"}
    first = await client.post(
        "/upload", data=io.BytesIO(("{" + items + "}").encode()), headers=headers
    )
    assert first.status == 200
    second = await client.post(
        "/upload", data=io.BytesIO(("{" + reordered + "}").encode()), headers=headers
    )
    assert second.status == 409
