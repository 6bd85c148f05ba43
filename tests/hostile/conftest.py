"""Fixtures for the hostile tests: a faulty upstream, a really listening proxy, counted stores.

* `backend_url`, `ledger`, `make_proxy`, `proxy`, `jobs`: as in tests/proxy (re-exported from
  tests/support/proxyapp.py).
* `fault_proxy`: tests/support/faultproxy.py between the proxy and the recording backend.
* `sqlite_jobs`: a handle on the `sqlite_dsn` database, for tests that run on SQLite only.
* `listening_proxy(**overrides)`: the proxy app behind the listener `idemproxy serve` uses
  (`web.AppRunner` with handler_cancellation=False + `GuardedSite`) on 127.0.0.1, for raw-socket
  tests; returns its (host, port).
* `CountingStore`: the real SQLite store, recording every hot-path call it gets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from idemproxy.config.settings import load_settings
from idemproxy.core.types import Intent
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.app import create_app
from idemproxy.proxy.context import CONTEXT
from idemproxy.proxy.server.connection import GuardedSite
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from idemproxy.store.sqlite.store import SqliteStore
from tests.support.faultproxy import FaultProxy
from tests.support.proxyapp import backend_url, jobs, ledger, make_proxy, proxy
from tests.support.stores import opened

__all__ = ["backend_url", "jobs", "ledger", "make_proxy", "proxy"]

# The store methods a request can call (the housekeeping ones run in the background).
HOT_PATH = (
    "claim",
    "get",
    "watch_job",
    "complete",
    "settle",
    "finish_attempt",
    "start_next_attempt",
    "fail_over",
    "add_attempt",
    "renew_lease",
    "take_over",
    "forget",
)


class CountingStore(SqliteStore):
    """The real SQLite store (a thin subclass, not a fake) that records each hot-path call:
    `calls` holds the method names in order, `intents` what each claim was asked to create."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.calls: list[str] = []
        self.intents: list[Intent] = []
        for name in HOT_PATH:
            setattr(self, name, self._counted(name, getattr(self, name)))

    def _counted(self, name: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == "claim":
                self.intents.append(args[0])
            return await method(*args, **kwargs)

        return counted


@pytest.fixture
async def counting_store(tmp_path: Any) -> AsyncIterator[CountingStore]:
    async with opened(CountingStore(str(tmp_path / "counted.db"))) as store:
        yield store


@pytest.fixture
async def fault_proxy(backend_url: str) -> AsyncIterator[FaultProxy]:
    relay = FaultProxy(backend_port=urlsplit(backend_url).port or 0)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()


@pytest.fixture
async def sqlite_jobs(sqlite_dsn: str) -> AsyncIterator[Store]:
    async with opened(create_store(sqlite_dsn)) as store:
        yield store


class ListeningProxy(Protocol):
    async def __call__(
        self, *, inject_store: Store | None = None, metrics: Metrics | None = None, **overrides: Any
    ) -> tuple[str, int]: ...


@pytest.fixture
async def listening_proxy(backend_url: str, sqlite_dsn: str) -> AsyncIterator[ListeningProxy]:
    """The proxy as `idemproxy serve` runs it (server.py): AppRunner + GuardedSite."""
    runners: list[web.AppRunner] = []
    sites: list[GuardedSite] = []

    async def start(
        *, inject_store: Store | None = None, metrics: Metrics | None = None, **overrides: Any
    ) -> tuple[str, int]:
        settings = load_settings(**{"upstream": backend_url, "store": sqlite_dsn, **overrides})
        runner = web.AppRunner(
            create_app(settings, store=inject_store, metrics=metrics),
            access_log=None,
            handler_cancellation=False,
            keepalive_timeout=settings.server.keepalive_timeout,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        runners.append(runner)
        ctx = runner.app[CONTEXT]
        site = GuardedSite(runner, "127.0.0.1:0", settings.server, settings.limits, ctx.metrics)
        await site.start()
        sites.append(site)
        host, port = site.addresses[0][:2]
        return host, port

    try:
        yield start
    finally:
        for site in reversed(sites):
            await site.stop()
        for runner in reversed(runners):
            with contextlib.suppress(asyncio.TimeoutError):
                await runner.cleanup()
