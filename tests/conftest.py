"""Shared fixtures: a fresh database per test, for every store backend.

PostgreSQL tests get a database of their own, in the state of a fresh clone of a session-wide
template that already holds every migration (`CREATE DATABASE … TEMPLATE …` is far cheaper than
migrating each time; emptying a used clone of the same shape is cheaper still). The server
comes from `IDEMPROXY_TEST_POSTGRES`; only databases named `idemproxy_test_…` that these
fixtures created are ever touched.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest
from hypothesis import settings

from idemproxy.redact import redact_url
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from tests.support.citus import CitusCluster, CitusUnavailable
from tests.support.loop import run_private
from tests.support.pgserver import PostgresUnavailable
from tests.support.prerequisites import missing
from tests.support.stores import distribute_postgres, empty_jobs, migrate_postgres, opened

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


# The clone keeper: a process of its own (not a thread, which would wait for the GIL while a
# test keeps it busy). It reads `want` lines, answering each with `ok NAME` (a database in the
# state of a fresh clone) or `error …`, and `recycle NAME` / `drop NAME` lines for databases a
# test is done with; at the end of its input it drops every database it holds and reports the
# drops that failed. A recycled database goes back to the state of a fresh clone (its sessions
# ended, its tables emptied) only if its shape is still exactly the fresh clone's; anything
# else (a schema, a setting, a prepared transaction, a failure) and it is dropped instead.
# Emptying two tables costs the server far less than `CREATE DATABASE … TEMPLATE` (which
# writes the whole template, catalogs included, to the WAL) and `DROP DATABASE`.
_CLONE_KEEPER = r'''
import asyncio, itertools, sys
from urllib.parse import urlsplit
import asyncpg

USER = "n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname !~ '^pg_(toast|temp_)'"
SHAPE = f"""
SELECT coalesce(string_agg(item, E'\n' ORDER BY item), '') FROM (
  SELECT 'namespace ' || n.nspname || ' ' || n.nspowner::regrole || ' '
      || coalesce(n.nspacl::text, '')
    FROM pg_namespace n WHERE {USER}
  UNION ALL SELECT 'relation ' || c.oid::regclass || ' ' || c.relkind::text
      || c.relpersistence::text || ' ' || c.relowner::regrole || ' '
      || coalesce(c.relacl::text, '') || ' ' || c.relrowsecurity
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {USER}
  UNION ALL SELECT 'column ' || c.oid::regclass || '.' || a.attname || ' '
      || format_type(a.atttypid, a.atttypmod) || ' ' || a.attnotnull || ' '
      || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
    FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE {USER} AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL SELECT 'index ' || pg_get_indexdef(i.indexrelid) || ' ' || i.indisvalid
    FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {USER}
  UNION ALL SELECT 'constraint ' || k.conrelid::regclass || ' ' || k.conname || ' '
      || pg_get_constraintdef(k.oid) || ' ' || k.convalidated
    FROM pg_constraint k JOIN pg_namespace n ON n.oid = k.connamespace WHERE {USER}
  UNION ALL SELECT 'type ' || t.typname || ' ' || t.typtype::text
    FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace WHERE {USER}
  UNION ALL SELECT 'function ' || p.oid::regprocedure || ' ' || md5(p.prosrc)
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE {USER}
  UNION ALL SELECT 'trigger ' || tgrelid::regclass || ' ' || tgname || ' ' || tgenabled::text
    FROM pg_trigger WHERE NOT tgisinternal
  UNION ALL SELECT 'rule ' || r.rulename FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class
    JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {USER}
  UNION ALL SELECT 'policy ' || polname FROM pg_policy
  UNION ALL SELECT 'event trigger ' || evtname FROM pg_event_trigger
  UNION ALL SELECT 'extension ' || extname || ' ' || extversion FROM pg_extension
  UNION ALL SELECT 'publication ' || pubname FROM pg_publication
  UNION ALL SELECT 'migration ' || version FROM idemproxy.schema_migrations
  -- A TRUNCATE keeps the planner's statistics: a clone a test analyzed is not fresh.
  UNION ALL SELECT 'statistics ' || count(*) FROM pg_statistic s
    JOIN pg_class c ON c.oid = s.starelid JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE {USER}
  UNION ALL SELECT 'large objects ' || count(*) FROM pg_largeobject_metadata
  UNION ALL SELECT 'prepared ' || count(*) FROM pg_prepared_xacts
    WHERE database = current_database()
  UNION ALL SELECT 'settings ' || setrole || ' ' || setconfig::text FROM pg_db_role_setting
    WHERE setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())
  UNION ALL SELECT 'database ' || datallowconn || ' ' || datconnlimit || ' ' || datdba::regrole
      || ' ' || coalesce(datacl::text, '')
    FROM pg_database WHERE datname = current_database()
) shape(item)
"""
DATA = f"""
SELECT string_agg(c.oid::regclass::text, ', ') FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE {USER} AND c.relkind IN ('r', 'p') AND c.oid <> 'idemproxy.schema_migrations'::regclass
"""


class Keeper:
    def __init__(self, server, template, prefix):
        self.server, self.template, self.prefix = server, template, prefix
        self.names = itertools.count(1)
        self.spares = []
        self.fresh_shape = None
        self.failed = []

    async def connect(self, database=None):
        # A server shared with other test runs may be out of connections for a moment.
        dsn = self.server
        if database is not None:
            dsn = urlsplit(dsn)._replace(path=f"/{database}").geturl()
        for _ in range(20):
            try:
                return await asyncpg.connect(dsn)
            except asyncpg.TooManyConnectionsError:
                await asyncio.sleep(0.5)
        return await asyncpg.connect(dsn)

    async def admin(self, sql, *args):
        conn = await self.connect()
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    async def shape(self, name):
        conn = await self.connect(name)
        try:
            return await conn.fetchval(SHAPE)
        finally:
            await conn.close()

    async def want(self):
        if self.spares:
            return self.spares.pop()
        name = f"{self.prefix}_{next(self.names)}"
        await self.admin(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        if self.fresh_shape is None:
            try:
                self.fresh_shape = await self.shape(name)
            except Exception:
                await self.drop(name)
                raise
        return name

    async def recycle(self, name):
        try:
            await self.admin(
                "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity"
                " WHERE datname = $1 AND pid <> pg_backend_pid()",
                name,
            )
            if await self.admin("SELECT count(*) FROM pg_stat_activity WHERE datname = $1", name):
                raise RuntimeError("sessions left")
            conn = await self.connect(name)
            try:
                if await conn.fetchval(SHAPE) != self.fresh_shape:
                    raise RuntimeError("not the shape of a fresh clone")
                await conn.execute(f"TRUNCATE {await conn.fetchval(DATA)} RESTART IDENTITY")
            finally:
                await conn.close()
        except Exception:
            await self.drop(name)
        else:
            self.spares.append(name)

    async def drop(self, name):
        try:
            await self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except Exception as exc:
            self.failed.append(f"{name}: {exc!r}")


async def main(server, template, prefix):
    keeper = Keeper(server, template, prefix)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        action, *name = line.split()
        if action == "want":
            try:
                print("ok", await keeper.want(), flush=True)
            except Exception as exc:
                print("error", repr(exc).replace("\n", " "), flush=True)
        elif action == "recycle":
            await keeper.recycle(*name)
        else:
            await keeper.drop(*name)
    for name in keeper.spares:
        await keeper.drop(name)
    print("failed", repr(keeper.failed), flush=True)

asyncio.run(main(*sys.argv[1:]))
'''


class TemplateClones:
    """Databases in the state of a fresh clone of the template, kept by a process of their own
    (`_CLONE_KEEPER`): the next one is made ready while a test runs, and a test never waits for
    `CREATE DATABASE` or `DROP DATABASE` itself."""

    def __init__(self, template: str) -> None:
        self._keeper = subprocess.Popen(
            [sys.executable, "-c", _CLONE_KEEPER, SERVER_DSN, template, _PREFIX],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._wanted = 0  # `want` lines not answered yet
        self._want()

    def take(self) -> str:
        """A database no test uses; the next one is asked for at once."""
        self._want()
        answer = self._answer()
        self._wanted -= 1
        if not answer.startswith("ok "):
            raise RuntimeError(f"no fresh clone of the template: {answer}")
        return answer.removeprefix("ok ")

    def give_back(self, name: str) -> None:
        self._send(f"recycle {name}")

    def close(self) -> None:
        """Drop every database, in use or not; fail if any of them could not be dropped."""
        with self._keeper:  # closes its pipes and reaps it
            for _ in range(self._wanted):
                answer = self._answer()
                if answer.startswith("ok "):
                    self._send(f"drop {answer.removeprefix('ok ')}")
            assert self._keeper.stdin is not None
            self._keeper.stdin.close()
            report = self._answer()
        assert report == "failed []", f"databases not dropped: {report}"

    def _want(self) -> None:
        self._send("want")
        self._wanted += 1

    def _send(self, line: str) -> None:
        assert self._keeper.stdin is not None
        self._keeper.stdin.write(line + "\n")
        self._keeper.stdin.flush()

    def _answer(self) -> str:
        assert self._keeper.stdout is not None
        line = self._keeper.stdout.readline()
        if not line:
            raise RuntimeError(f"the clone keeper exited ({self._keeper.poll()})")
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


# The xdist group (scripts/test runs the suite in parallel workers, `--dist loadgroup`) of every
# test on the Citus cluster: one worker runs them all, so one cluster starts, not one a worker.
CITUS_GROUP = "citus"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if item.get_closest_marker("citus") is not None or "citus_cluster" in fixtures:
            item.add_marker(pytest.mark.xdist_group(CITUS_GROUP))


@pytest.fixture(scope="session")
def citus_cluster() -> Iterator[CitusCluster]:
    """A real Citus cluster, a coordinator and two workers (tests/support/citus.py), for the
    whole session: starting one costs seconds, emptying its tables milliseconds."""
    try:
        cluster = CitusCluster()
    except (CitusUnavailable, PostgresUnavailable) as exc:
        missing(str(exc))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture(scope="session")
def citus_database(citus_cluster: CitusCluster) -> str:
    """The session's database on the cluster: migrated, both tables distributed by owner."""
    dsn = run_private(citus_cluster.create_database("idemproxy_test"))
    run_private(distribute_postgres(dsn))
    return dsn


@pytest.fixture
def citus_dsn(citus_database: str) -> str:
    """The cluster's database, emptied for one test (its shards on both workers)."""
    run_private(empty_jobs(citus_database))
    return citus_database


@pytest.fixture(
    params=[
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("citus", marks=pytest.mark.citus),
    ]
)
def replicated_dsn(request: pytest.FixtureRequest) -> str:
    """A database that several stores (replicas) share: PostgreSQL, then a Citus cluster's
    coordinator, where statements routed to a worker must still wake the other replicas."""
    dsn: str = request.getfixturevalue({"postgres": "pg_dsn", "citus": "citus_dsn"}[request.param])
    return dsn


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
