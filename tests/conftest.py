"""Shared fixtures: a fresh database per test, for every store backend.

PostgreSQL tests get their own database, cloned from a session-wide template that already holds
every migration (`CREATE DATABASE … TEMPLATE …` is far cheaper than migrating each time). The
server comes from `IDEMPROXY_TEST_POSTGRES`; only databases named `idemproxy_test_…` that these
fixtures created are ever touched.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg
import pytest
from hypothesis import settings

from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from idemproxy.store.postgres.store import PostgresStore

T = TypeVar("T")

# Property-based tests draw the same examples on every run by default ("repeatable"): a failure
# in one run is a failure in every run, never a draw of luck in CI. A search for new failures
# draws fresh ones each run: IDEMPROXY_HYPOTHESIS=explore (docs/reliability.md, Model-based test).
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("IDEMPROXY_HYPOTHESIS", "repeatable"))

SERVER_DSN = os.environ.get(
    "IDEMPROXY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
# Unique across pytest processes running at once against the same server.
_PREFIX = f"idemproxy_test_{os.getpid()}_{secrets.token_hex(3)}"
_counter = itertools.count(1)


def database_dsn(name: str) -> str:
    """The server DSN pointed at database `name`."""
    return urlsplit(SERVER_DSN)._replace(path=f"/{name}").geturl()


def run_admin(coro: Coroutine[Any, Any, T]) -> T:
    """Run setup SQL on a private event loop, so fixtures work for sync and async tests alike."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def _execute(sql: str) -> None:
    conn = await asyncpg.connect(SERVER_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def _migrate(dsn: str) -> None:
    store = PostgresStore(dsn, min_connections=1, max_connections=1, listen=False)
    await store.open()
    try:
        await store.migrate()
    finally:
        await store.close()


@pytest.fixture(scope="session")
def pg_server_dsn() -> str:
    """The test server's maintenance database: for admin statements only, never for data."""
    return SERVER_DSN


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A database with every migration applied, cloned by `pg_dsn`; dropped at session end."""
    name = f"{_PREFIX}_template"
    run_admin(_execute(f'CREATE DATABASE "{name}"'))
    try:
        run_admin(_migrate(database_dsn(name)))
        yield name
    finally:
        run_admin(_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


# The clone maker: one process of its own (not a thread, which would wait for the GIL while a
# test keeps it busy), reading `create NAME` / `drop NAME` lines and answering each `create`
# with `ok NAME` or `error NAME …`; at the end of its input it reports the drops that failed.
_CLONE_MAKER = """
import asyncio, sys
import asyncpg

async def main(server, template):
    failed = []
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        action, name = line.split()
        try:
            conn = await asyncpg.connect(server)
            try:
                if action == "create":
                    await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
                else:
                    await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            finally:
                await conn.close()
        except Exception as exc:
            if action == "create":
                print("error", name, repr(exc).replace("\\n", " "), flush=True)
            else:
                failed.append(f"{name}: {exc!r}")
        else:
            if action == "create":
                print("ok", name, flush=True)
    print("failed", repr(failed), flush=True)

asyncio.run(main(*sys.argv[1:]))
"""


class TemplateClones:
    """Clones of the template made by a process of their own ahead of the tests that take them,
    and dropped there after them: each test still gets a database nobody used before, but does
    not wait for `CREATE DATABASE` and `DROP DATABASE` (about half a second together) itself."""

    AHEAD = 2  # clones made or being made while a test runs

    def __init__(self, template: str) -> None:
        self._maker = subprocess.Popen(
            [sys.executable, "-c", _CLONE_MAKER, SERVER_DSN, template],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._ordered: list[str] = []  # names asked for and not answered yet, oldest first
        for _ in range(self.AHEAD):
            self._order()

    def take(self) -> str:
        """A fresh clone; another one is ordered for the next test."""
        self._order()
        name = self._ordered.pop(0)
        answer = self._answer()
        if answer != f"ok {name}":
            raise RuntimeError(f"cloning the template failed: {answer}")
        return name

    def give_back(self, name: str) -> None:
        self._send(f"drop {name}")

    def close(self) -> None:
        """Drop every clone, taken or not; fail if any of them could not be dropped."""
        with self._maker:  # closes its pipes and reaps it
            for name in self._ordered:
                if self._answer() == f"ok {name}":
                    self._send(f"drop {name}")
            assert self._maker.stdin is not None
            self._maker.stdin.close()
            report = self._answer()
        assert report == "failed []", f"databases not dropped: {report}"

    def _order(self) -> None:
        name = f"{_PREFIX}_{next(_counter)}"
        self._send(f"create {name}")
        self._ordered.append(name)

    def _send(self, line: str) -> None:
        assert self._maker.stdin is not None
        self._maker.stdin.write(line + "\n")
        self._maker.stdin.flush()

    def _answer(self) -> str:
        assert self._maker.stdout is not None
        line = self._maker.stdout.readline()
        if not line:
            raise RuntimeError(f"the clone maker exited ({self._maker.poll()})")
        return line.strip()


@pytest.fixture(scope="session")
def pg_clones(pg_template: str) -> Iterator[TemplateClones]:
    clones = TemplateClones(pg_template)
    try:
        yield clones
    finally:
        clones.close()


@pytest.fixture
def pg_dsn(pg_clones: TemplateClones) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for one test."""
    name = pg_clones.take()
    try:
        yield database_dsn(name)
    finally:
        pg_clones.give_back(name)


@pytest.fixture
def sqlite_dsn(tmp_path: Path) -> str:
    """A new SQLite database file for one test."""
    return f"sqlite:///{tmp_path}/idemproxy.db"


_DSN_FIXTURES = {"sqlite": "sqlite_dsn", "postgres": "pg_dsn"}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_dsn(request: pytest.FixtureRequest) -> str:
    """Each backend in turn; the PostgreSQL fixtures are only set up when needed."""
    dsn: str = request.getfixturevalue(_DSN_FIXTURES[request.param])
    return dsn


@pytest.fixture
async def store(store_dsn: str) -> AsyncIterator[Store]:
    """An open, migrated store on a fresh database."""
    store = create_store(store_dsn)
    await store.open()
    try:
        await store.migrate()
        yield store
    finally:
        await store.close()
