"""Fixtures for the tests that break PostgreSQL: a throwaway server (tests/support/pgserver.py).

* `throwaway_pg`: one private PostgreSQL for the session, with a migrated template database. It
  is started here or the session errors (never skipped): these tests are the proof that the
  proxy fails closed and recovers.
* `fault_db`: a fresh database per test, cloned from the template, on a server that is running
  and not frozen whatever the previous test did to it. Its DSN carries `application_name`, so
  that `pg_stat_activity` tells the proxy's connections apart.
* `proxy_app(**overrides)`: the proxy app in-process (`create_app`) in front of the recording
  backend, on `fault_db`, with a short store timeout and lease.
* `governed_proxy(kind, **overrides)`: the same settings either in-process (`"app"`) or as a
  real `python -m idemproxy serve` process (`"process"`, via tests/support/processes.py).
* `cut`: a relay in front of `fault_db`'s server that cuts a connection once a statement
  committed (tests/faults/pgcut.py); `fault_db.dsn_through(cut)` is the proxy's DSN through it.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
from aiohttp.test_utils import TestClient

from idemproxy.config.settings import PoolSettings, load_settings
from idemproxy.proxy.app import create_app
from tests.support.backend import Ledger, serving
from tests.support.loop import run_private
from tests.support.pgserver import PostgresUnavailable, ThrowawayPostgres, find_bindir
from tests.support.prerequisites import missing
from tests.support.processes import ProxyProcess, StartProxy, start_proxy
from tests.support.proxyapp import ProxyClient, Server
from tests.support.stores import migrate_postgres

from .pgcut import StatementCut

__all__ = ["start_proxy"]

TEMPLATE = "idemproxy_fault_template"
APPLICATION_NAME = "idemproxy-under-test"
STORE_TIMEOUT = 0.5  # seconds: pool.store_timeout, so that a stalled store fails fast
POOL_MAX = 4  # pool.store_connections: few, so that a leak shows
LEASE_CONNECTIONS = 2  # pool.lease_connections: reserved for lease renewals (SPEC §3.5)
# Every connection a proxy may hold: the pool, the renewals' pool and the change feed.
CONNECTIONS_MAX = POOL_MAX + LEASE_CONNECTIONS + 1
LEASE = 1.0
_databases = itertools.count(1)


@pytest.fixture(scope="session")
def throwaway_pg() -> Iterator[ThrowawayPostgres]:
    try:
        find_bindir()
    except PostgresUnavailable as exc:  # not installed: a skip that says so (or a failure in CI)
        missing(str(exc))
    server = ThrowawayPostgres()
    try:
        server.start()  # PostgresUnavailable here (installed, but failed) is an error, on purpose
        run_private(server.execute(f'CREATE DATABASE "{TEMPLATE}"'))
        run_private(migrate_postgres(server.dsn(TEMPLATE)))
        yield server
    finally:
        server.destroy()


@dataclass(frozen=True)
class FaultDatabase:
    server: ThrowawayPostgres
    name: str

    @property
    def dsn(self) -> str:
        """For the proxy: its connections carry APPLICATION_NAME."""
        return self.dsn_via(None)

    def dsn_via(self, port: int | None) -> str:
        """The proxy's DSN through a relay listening on `port`."""
        return self.server.dsn(self.name, port=port, application_name=APPLICATION_NAME)

    def dsn_through(self, relay: StatementCut) -> str:
        """The proxy's DSN through `relay`, which reads the protocol: in the clear."""
        return self.server.dsn(
            self.name, port=relay.port, application_name=APPLICATION_NAME, sslmode="disable"
        )

    @property
    def admin_dsn(self) -> str:
        """For the test's own look at the data (another application_name)."""
        return self.server.dsn(self.name, application_name="fault-test")

    async def proxy_connections(self) -> int:
        rows = await self.server.backends(self.name)
        return sum(1 for row in rows if row["application_name"] == APPLICATION_NAME)


@pytest.fixture
def fault_db(throwaway_pg: ThrowawayPostgres) -> Iterator[FaultDatabase]:
    throwaway_pg.resume()  # heal whatever the previous test did to the server
    throwaway_pg.start()
    name = f"fault_{next(_databases)}"
    run_private(throwaway_pg.execute(f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE}"'))
    try:
        yield FaultDatabase(throwaway_pg, name)
    finally:
        throwaway_pg.resume()
        throwaway_pg.start()
        run_private(throwaway_pg.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def cut(fault_db: FaultDatabase) -> AsyncIterator[StatementCut]:
    relay = StatementCut(fault_db.server.port)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()


@pytest.fixture
async def recording_backend() -> AsyncIterator[tuple[str, Ledger]]:
    """The recording upstream (tests/support/backend.py) in-process: (url, ledger)."""
    ledger = Ledger()
    async with serving(ledger) as url:
        yield url, ledger


class StartApp(Protocol):
    async def __call__(self, **overrides: Any) -> ProxyClient: ...


def fault_settings(store: str, upstream: str, /, **overrides: Any) -> dict[str, Any]:
    """The settings every fault test starts from: short timeouts, a small pool."""
    return {
        "upstream": upstream,
        "store": store,
        "lease": LEASE,
        "pool": PoolSettings(
            store_connections=POOL_MAX,
            store_timeout=STORE_TIMEOUT,
            lease_connections=LEASE_CONNECTIONS,
        ),
        "log_requests": False,
        **overrides,
    }


@dataclass(frozen=True)
class RunningProxy:
    url: str
    process: ProxyProcess | None  # None: in-process


class GovernedProxy(Protocol):
    async def __call__(self, kind: str, **overrides: Any) -> RunningProxy: ...


@pytest.fixture
async def governed_proxy(
    proxy_app: StartApp,
    start_proxy: StartProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
) -> GovernedProxy:
    """`await governed_proxy("app" | "process", **overrides)` on `fault_db`; top-level settings
    only (they become `IDEMPROXY_<NAME>` for a process)."""

    async def start(kind: str, **overrides: Any) -> RunningProxy:
        if kind == "app":
            client = await proxy_app(**overrides)
            return RunningProxy(f"http://{client.server.host}:{client.server.port}", None)
        settings = fault_settings(fault_db.dsn, recording_backend[0], **overrides)
        pool = settings.pop("pool")
        env = {f"IDEMPROXY_{name.upper()}": str(value) for name, value in settings.items()}
        env["IDEMPROXY_POOL__STORE_CONNECTIONS"] = str(pool.store_connections)
        env["IDEMPROXY_POOL__STORE_TIMEOUT"] = str(pool.store_timeout)
        env["IDEMPROXY_POOL__LEASE_CONNECTIONS"] = str(pool.lease_connections)
        process = await start_proxy(env=env, name="faulted")
        return RunningProxy(process.url, process)

    return start


@pytest.fixture
async def proxy_app(
    fault_db: FaultDatabase, recording_backend: tuple[str, Ledger]
) -> AsyncIterator[StartApp]:
    """`await proxy_app(**overrides)`: a test client for the proxy app on `fault_db`."""
    clients: list[ProxyClient] = []

    async def start(**overrides: Any) -> ProxyClient:
        settings = load_settings(**fault_settings(fault_db.dsn, recording_backend[0], **overrides))
        client: ProxyClient = TestClient(Server(create_app(settings)))
        await client.start_server()
        clients.append(client)
        return client

    try:
        yield start
    finally:
        for client in clients:
            await client.close()
