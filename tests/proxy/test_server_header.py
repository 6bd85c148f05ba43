"""The Server field on the wire (SPEC §10): the proxy's own answers name `server.server_token`
(none when empty), never aiohttp's `Python/x aiohttp/y`; an upstream's answers, first or
replayed, carry the upstream's own Server field as it sent it, or none."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from email.utils import parsedate_to_datetime
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from idemproxy.admin.app import Readiness, create_admin_app
from idemproxy.config.settings import load_settings
from idemproxy.store.factory import create_store
from tests.support.proxyapp import ProxyClient, ProxyFactory, RawUpstream

SMALL = b"HTTP/1.1 201 Created\r\n{server}Content-Length: 2\r\nConnection: close\r\n\r\nok"
STREAMED = (
    b"HTTP/1.1 201 Created\r\n{server}Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    b"2\r\nok\r\n0\r\n\r\n"
)
UPSTREAM_SERVER = b"Server: Upstream/9.1 (backend)\r\n"


async def _head(port: int, request: bytes) -> CIMultiDict[str]:
    """The header fields of the first response on a new connection, as bytes on the wire."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    finally:
        writer.close()
    fields: CIMultiDict[str] = CIMultiDict()
    for line in head.decode("latin-1").split("\r\n")[1:]:
        if line:
            name, _, value = line.partition(":")
            fields.add(name, value.strip())
    return fields


def _request(method: str, path: str, *, key: str | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: proxy", "Content-Length: 2"]
    if key is not None:
        lines.append(f"Idempotency-Key: {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + b"{}"


def _port(client: ProxyClient) -> int:
    port = client.server.port
    assert port is not None
    return port


@pytest.mark.parametrize(
    ("token", "expected"), [(None, ["idemproxy"]), ("acme", ["acme"]), ("", [])]
)
@pytest.mark.parametrize("method", ["POST", "HEAD"])  # one write; aiohttp's path (HEAD)
async def test_problem_answers_name_the_configured_token(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    token: str | None,
    expected: list[str],
    method: str,
) -> None:
    server: dict[str, Any] = {} if token is None else {"server": {"server_token": token}}
    client = await make_proxy(store=sqlite_dsn, **server)
    bad_host = _request(method, "/pay").replace(b"Host: proxy", b"Host: x/y")  # 400
    fields = await _head(_port(client), bad_host)
    assert "Idempotency-Error" in fields  # the proxy's own answer
    assert fields.getall("Server", []) == expected
    # Refused by the HTTP parser, before any request exists (no application hook runs).
    for malformed in (b"GARBAGE\r\n\r\n", b"POST / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n"):
        refused = await _head(_port(client), malformed)
        assert refused.getall("Server", []) == expected
        # RFC 9110 §6.6.1: a 4xx of a server with a clock carries the date.
        assert parsedate_to_datetime(refused["Date"]).tzinfo is not None


@pytest.mark.parametrize("shape", [SMALL, STREAMED])
@pytest.mark.parametrize("upstream_server", [UPSTREAM_SERVER, b""])
async def test_pass_through_keeps_the_upstreams_server_or_none(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    raw_upstream: RawUpstream,
    shape: bytes,
    upstream_server: bytes,
) -> None:
    raw_upstream.response = shape.replace(b"{server}", upstream_server)
    client = await make_proxy(store=sqlite_dsn, upstream=raw_upstream.url)
    fields = await _head(_port(client), _request("GET", "/balance"))
    expected = ["Upstream/9.1 (backend)"] if upstream_server else []
    assert fields.getall("Server", []) == expected


@pytest.mark.parametrize("shape", [SMALL, STREAMED])
@pytest.mark.parametrize("upstream_server", [UPSTREAM_SERVER, b""])
async def test_first_answers_and_replays_carry_the_upstreams_server_or_none(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    raw_upstream: RawUpstream,
    shape: bytes,
    upstream_server: bytes,
) -> None:
    raw_upstream.response = shape.replace(b"{server}", upstream_server)
    client = await make_proxy(store=sqlite_dsn, upstream=raw_upstream.url)
    expected = ["Upstream/9.1 (backend)"] if upstream_server else []
    first = await _head(_port(client), _request("POST", "/pay", key="k1"))
    replay = await _head(_port(client), _request("POST", "/pay", key="k1"))
    assert first.getall("Server", []) == expected
    assert "Idempotent-Replayed" in replay or len(raw_upstream.heads) == 1
    assert replay.getall("Server", []) == expected
    assert len(raw_upstream.heads) == 1


@pytest.fixture
async def admin_port(sqlite_dsn: str) -> AsyncIterator[dict[str, int]]:
    """The admin listener with the default token and with none."""
    store = create_store(sqlite_dsn)
    await store.open()
    await store.migrate()
    ports = {}
    servers = []
    for token in ("idemproxy", ""):
        settings = load_settings(
            upstream="http://127.0.0.1:9", store=sqlite_dsn, server={"server_token": token}
        )
        server = TestServer(create_admin_app(settings, store, Readiness()))
        await server.start_server()
        servers.append(server)
        assert server.port is not None
        ports[token] = server.port
    try:
        yield ports
    finally:
        for server in servers:
            await server.close()
        await store.close()


async def test_admin_answers_name_the_token_or_nothing(admin_port: dict[str, int]) -> None:
    for path in ("/healthz", "/jobs/nope"):
        request = f"GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n".encode()
        assert (await _head(admin_port["idemproxy"], request)).getall("Server") == ["idemproxy"]
        assert "Server" not in await _head(admin_port[""], request)
