"""Fixtures for the admin jobs API: the admin app and the proxy app on one store, in process.

The upstream is a real aiohttp server whose answers are scripted per test (`upstream.script`):
each request executed takes the next status from the script, 201 once it runs out. That lets a
job become `unknown` by real means (a 504 through the proxy) and a retry then succeed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from idemproxy.admin.app import Readiness, create_admin_app
from idemproxy.config.settings import Settings, load_settings
from idemproxy.proxy.app import create_app
from idemproxy.store.base import Store

ALICE = {"Authorization": "Bearer alice"}
BOB = {"Authorization": "Bearer bob"}
TOKEN = "admin-token-2718"


@dataclass
class Upstream:
    url: str = ""
    script: list[int] = field(default_factory=list)
    # Seconds each execution takes before answering, in order; none once it runs out.
    delays: list[float] = field(default_factory=list)
    executions: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.executions += 1
        status = self.script.pop(0) if self.script else 201
        if self.delays:
            await asyncio.sleep(self.delays.pop(0))
        echo = {"execution": self.executions, "body": body.decode("utf-8", "replace")}
        return web.json_response(echo, status=status, headers={"Location": "/things/1"})


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    scripted = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", scripted.handle)
    server = TestServer(app)
    await server.start_server()
    scripted.url = f"http://{server.host}:{server.port}"
    try:
        yield scripted
    finally:
        await server.close()


class MakeSettings(Protocol):
    def __call__(self, **overrides: Any) -> Settings: ...


@pytest.fixture
def make_settings(store_dsn: str, upstream: Upstream) -> MakeSettings:
    def make(**overrides: Any) -> Settings:
        return load_settings(**{"upstream": upstream.url, "store": store_dsn, **overrides})

    return make


class MakeClient(Protocol):
    async def __call__(self, settings: Settings | None = None) -> TestClient[Any, Any]: ...


@pytest.fixture
async def clients() -> AsyncIterator[list[TestClient[Any, Any]]]:
    started: list[TestClient[Any, Any]] = []
    try:
        yield started
    finally:
        for client in reversed(started):
            await client.close()


@pytest.fixture
def make_admin(
    store: Store, make_settings: MakeSettings, clients: list[TestClient[Any, Any]]
) -> MakeClient:
    """The admin app on the test's store (shared with the proxy, as `idemproxy serve` does)."""

    async def make(settings: Settings | None = None) -> TestClient[Any, Any]:
        app = create_admin_app(settings or make_settings(), store, Readiness())
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    return make


@pytest.fixture
def make_proxy(
    store: Store, make_settings: MakeSettings, clients: list[TestClient[Any, Any]]
) -> MakeClient:
    async def make(settings: Settings | None = None) -> TestClient[Any, Any]:
        client = TestClient(TestServer(create_app(settings or make_settings(), store=store)))
        await client.start_server()
        clients.append(client)
        return client

    return make


@pytest.fixture
async def admin(make_admin: MakeClient) -> TestClient[Any, Any]:
    return await make_admin()


@pytest.fixture
async def proxy(make_proxy: MakeClient) -> TestClient[Any, Any]:
    return await make_proxy()


async def post(
    proxy: TestClient[Any, Any],
    key: str,
    *,
    owner: dict[str, str] = ALICE,
    body: dict[str, Any] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One governed request through the proxy: (status, headers, body)."""
    headers = {"Idempotency-Key": key, "Content-Type": "application/json", **owner}
    payload = json.dumps(body or {"amount": 100}).encode()
    async with proxy.post("/charges", data=payload, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()
