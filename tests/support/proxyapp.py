"""The real proxy app in process, in front of the recording upstream, and a raw TCP upstream.

Fixtures (a conftest imports them to use them):

* `backend_url`: the recording upstream of tests/support/backend.py; its executions land in
  `ledger`.
* `proxy(**overrides)`: starts the proxy app on the `store_dsn` database (so every test runs on
  SQLite and PostgreSQL) behind the listener `idemproxy serve` uses, and returns a test client;
  `make_proxy` is the same without a default store, for tests that pick their own.
* `jobs`: a second handle on the same database, to look at job state (and to sweep).
* `raw_upstream`: a bare TCP upstream that records exact request bytes and answers canned bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeAlias

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from idemproxy.config.settings import ServerSettings, load_settings
from idemproxy.proxy.app import create_app
from idemproxy.proxy.context import CONTEXT
from idemproxy.proxy.server.connection import GuardedSite
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from idemproxy.store.layers import Stacked
from tests.support.backend import Ledger, backend_app
from tests.support.stores import opened

# A test client of the proxy app (its `.app` is the proxy's aiohttp application).
ProxyClient: TypeAlias = "TestClient[web.Request, web.Application]"


class ProxyFactory(Protocol):
    async def __call__(
        self,
        *,
        inject_store: Stacked | None = None,
        handler_cancellation: bool = False,
        **overrides: Any,
    ) -> ProxyClient: ...


class Server(TestServer):
    """aiohttp's TestServer always cancels handlers when a client hangs up; real servers may not.

    `idemproxy.cli.serve.serve` runs with handler_cancellation=False, and so does a typical backend.
    """

    def __init__(self, app: web.Application, *, handler_cancellation: bool = False) -> None:
        super().__init__(app)
        self._handler_cancellation = handler_cancellation

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        kwargs["handler_cancellation"] = self._handler_cancellation
        return web.AppRunner(self.app, **kwargs)


@contextlib.asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    """`app` on an ephemeral port of 127.0.0.1 (a `Server`: it keeps executing when the proxy
    hangs up), its base URL while the block runs."""
    server = Server(app)
    await server.start_server()
    try:
        yield f"http://{server.host}:{server.port}"
    finally:
        await server.close()


class ServeListener(Server):
    """The proxy behind the listener `idemproxy serve` uses (`GuardedSite`: aiohttp's handler
    with the header-read deadline, one-write responses and no router, proxy/server/connection.py),
    on an ephemeral port of 127.0.0.1, so that the proxy's tests also test that listener."""

    def __init__(self, app: web.Application, settings: ServerSettings) -> None:
        super().__init__(app)
        self._settings = settings
        self.site: GuardedSite | None = None

    async def start_server(
        self, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any
    ) -> None:
        if self.runner:
            return
        self.runner = await self._make_runner(**kwargs)
        await self.runner.setup()
        ctx = self.runner.app[CONTEXT]  # built by runner.setup(), as in `idemproxy serve`
        listen = f"{self.host}:0"
        self.site = GuardedSite(
            self.runner, listen, self._settings, ctx.settings.limits, ctx.metrics
        )
        await self.site.start()
        self.port = self.site.addresses[0][1]
        self.scheme = "http"
        self._root = URL(f"http://{self.host}:{self.port}")

    async def close(self) -> None:
        """The listener's connections first (they are not the runner's), then the app."""
        site, self.site = self.site, None
        if site is not None:
            await site.stop()
        await super().close()


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
async def backend_url(ledger: Ledger) -> AsyncIterator[str]:
    """The recording upstream (tests/support/backend.py) on 127.0.0.1, an ephemeral port."""
    server = Server(backend_app(ledger))  # keeps executing when the proxy hangs up
    await server.start_server()
    try:
        yield f"http://{server.host}:{server.port}"
    finally:
        await server.close()


@pytest.fixture
async def make_proxy(backend_url: str) -> AsyncIterator[ProxyFactory]:
    """Start a proxy app with `load_settings(upstream=backend_url, **overrides)`; needs `store=`.

    The app owns its store unless `inject_store` is given. `handler_cancellation` defaults to
    False as in `idemproxy.cli.serve.serve`, and the proxy then listens as that command's does
    (`ServeListener`); with True it is aiohttp's test server, which cancels on hang-up. The
    client never decompresses (byte-identity checks) and keeps no cookies (a replay must not
    depend on what the first response set).
    """
    clients: list[ProxyClient] = []

    async def make(
        *,
        inject_store: Stacked | None = None,
        handler_cancellation: bool = False,
        **overrides: Any,
    ) -> ProxyClient:
        settings = load_settings(**{"upstream": backend_url, **overrides})
        app = create_app(settings, store=inject_store)
        server = (
            Server(app, handler_cancellation=True)
            if handler_cancellation
            else ServeListener(app, settings.server)
        )
        client = TestClient(server, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
        await client.start_server()
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for client in reversed(clients):
            await client.close()


@pytest.fixture
def proxy(store_dsn: str, make_proxy: ProxyFactory) -> ProxyFactory:
    """`make_proxy` on the `store_dsn` database: every test using it runs on both stores."""

    async def make(**kwargs: Any) -> ProxyClient:
        return await make_proxy(**{"store": store_dsn, **kwargs})

    return make


@pytest.fixture
async def jobs(store_dsn: str) -> AsyncIterator[Store]:
    """A second handle on the proxy's database, to inspect (and sweep) jobs."""
    async with opened(create_store(store_dsn)) as store:
        yield store


class RawUpstream:
    """A bare TCP upstream: records each request's exact head bytes, answers `response` bytes."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.response = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    await reader.readexactly(int(value))
            writer.write(self.response)
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@pytest.fixture
async def raw_upstream() -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream()
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        server.close()
        await server.wait_closed()
