"""Shared fixtures: a fresh database per test, for every store backend.

PostgreSQL tests get their own database, cloned from a session-wide template that already holds
every migration (`CREATE DATABASE … TEMPLATE …` is far cheaper than migrating each time). The
server comes from `IDEMPROXY_TEST_POSTGRES`; only databases named `idemproxy_test_…` that these
fixtures created are ever touched.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest
from hypothesis import settings

from idemproxy.redact import redact_url
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from tests.support.loop import run_private
from tests.support.prerequisites import missing
from tests.support.stores import migrate_postgres, opened

# Property-based tests draw the same examples on every run by default ("repeatable"): a failure
# in one run is a failure in every run, never a draw of luck in CI. A search for new failures
# draws fresh ones each run: IDEMPROXY_HYPOTHESIS=explore (docs/reliability.md, Model-based test).
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("IDEMPROXY_HYPOTHESIS", "repeatable"))

_SERVER_VARIABLE = "IDEMPROXY_TEST_POSTGRES"
SERVER_DSN = os.environ.get(_SERVER_VARIABLE, "postgresql://postgres@127.0.0.1:5432/postgres")
# Unique across pytest processes running at once against the same server.
_PREFIX = f"idemproxy_test_{os.getpid()}_{secrets.token_hex(3)}"
_counter = itertools.count(1)


def database_dsn(name: str) -> str:
    """The server DSN pointed at database `name`."""
    return urlsplit(SERVER_DSN)._replace(path=f"/{name}").geturl()


async def _execute(sql: str) -> None:
    conn = await asyncpg.connect(SERVER_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def pg_server_dsn() -> str:
    """The test server's maintenance database: for admin statements only, never for data.

    Without a server there, the tests that need one are skipped, saying so (or fail, where every
    test must run: tests/support/prerequisites.py)."""
    try:
        run_private(_execute("SELECT 1"))
    except (OSError, TimeoutError) as exc:  # refused, no such host: nothing to test against
        where = redact_url(SERVER_DSN)
        missing(
            f"no PostgreSQL server at {where} ({exc}); start one or set IDEMPROXY_TEST_POSTGRES"
        )
    return SERVER_DSN


@pytest.fixture(scope="session")
def pg_template(pg_server_dsn: str) -> Iterator[str]:
    """A database with every migration applied, cloned by `pg_dsn`; dropped at session end."""
    name = f"{_PREFIX}_template"
    run_private(_execute(f'CREATE DATABASE "{name}"'))
    try:
        run_private(migrate_postgres(database_dsn(name)))
        yield name
    finally:
        run_private(_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def pg_dsn(pg_template: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for one test."""
    name = f"{_PREFIX}_{next(_counter)}"
    run_private(_execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"'))
    try:
        yield database_dsn(name)
    finally:
        run_private(_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


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
    async with opened(create_store(store_dsn)) as store:
        yield store
