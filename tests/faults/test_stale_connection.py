"""SPEC §10: a request is never re-sent on a pooled connection once any byte of it was written.

The upstream here is a raw asyncio server: it answers the first request on a connection with a
keep-alive response, then reads the second request in full and closes the connection without a
word, as a server whose idle timeout fired at the wrong moment would. aiohttp's client would
silently re-send an idempotent request on a fresh connection; the proxy must not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from idemproxy.config.settings import load_settings
from idemproxy.core.types import JobState
from idemproxy.proxy.app import create_app
from idemproxy.store.factory import create_store

_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


class ClosingUpstream:
    def __init__(self) -> None:
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while await self._read_request(reader):
                self.requests += 1
                served += 1
                if served == 2:
                    break  # read in full, then hang up without an answer
                writer.write(_OK)
                await writer.drain()
        finally:
            writer.close()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> bool:
        head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
        if not head:
            return False
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                await reader.readexactly(int(line.split(b":")[1]))
        return True


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[ClosingUpstream, str]]:
    closing = ClosingUpstream()
    server = await asyncio.start_server(closing.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield closing, f"http://127.0.0.1:{port}"


@pytest.fixture
async def client(
    upstream: tuple[ClosingUpstream, str], sqlite_dsn: str
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    settings = load_settings(upstream=upstream[1], store=sqlite_dsn)
    async with TestClient(TestServer(create_app(settings))) as test_client:
        yield test_client


@pytest.mark.parametrize("method", ["PUT", "DELETE", "GET"])
async def test_idempotent_passthrough_is_not_resent(
    client: TestClient[web.Request, web.Application],
    upstream: tuple[ClosingUpstream, str],
    method: str,
) -> None:
    closing, _ = upstream
    first = await client.request(method, "/thing", data=b"x" if method == "PUT" else None)
    assert first.status == 200
    second = await client.request(method, "/thing", data=b"x" if method == "PUT" else None)
    assert second.status == 502
    assert second.headers["Idempotency-Error"] == "upstream-unavailable"
    assert closing.requests == 2


async def test_governed_request_cut_off_on_a_pooled_connection_is_unknown(
    client: TestClient[web.Request, web.Application],
    upstream: tuple[ClosingUpstream, str],
    sqlite_dsn: str,
) -> None:
    closing, _ = upstream
    assert (await client.post("/pay", data=b"1", headers={"Idempotency-Key": "k1"})).status == 200
    cut = await client.post("/pay", data=b"2", headers={"Idempotency-Key": "k2"})
    assert cut.status == 502
    assert closing.requests == 2
    store = create_store(sqlite_dsn)
    await store.open()
    try:
        job = await store.get("anonymous", "k2")
    finally:
        await store.close()
    assert job is not None and job.state is JobState.UNKNOWN
    retry = await client.post("/pay", data=b"2", headers={"Idempotency-Key": "k2"})
    assert retry.status == 409 and retry.headers["Idempotency-Error"] == "outcome-unknown"
    assert closing.requests == 2
