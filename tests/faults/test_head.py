"""HEAD through the proxy keeps the declared Content-Length, sends no body (RFC 9110 §9.3.2)."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from idemproxy.config.settings import load_settings
from idemproxy.proxy.app import create_app


async def _resource(_request: web.Request) -> web.Response:
    return web.Response(body=b"x" * 1234, content_type="application/octet-stream")


async def test_head_keeps_the_declared_length(sqlite_dsn: str) -> None:
    backend = web.Application()
    backend.router.add_get("/file", _resource)  # answers HEAD too
    async with TestServer(backend) as upstream:
        settings = load_settings(upstream=str(upstream.make_url("")), store=sqlite_dsn)
        async with TestClient(TestServer(create_app(settings))) as client:
            head = await client.head("/file")
            assert head.status == 200
            assert head.headers["Content-Length"] == "1234"
            assert await head.read() == b""
            get = await client.get("/file")
            assert await get.read() == b"x" * 1234
