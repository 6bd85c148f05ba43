"""A real Citus cluster of the test's own: a coordinator and two workers, each a throwaway
PostgreSQL (tests/support/pgserver.py) with `shared_preload_libraries = 'citus'`.

Citus is not part of PostgreSQL: `../shared/citus/install` puts a build for PostgreSQL 15 next
to the server binaries (CI runs it, .ci/run). Without it the tests that need a cluster are
skipped, saying so, or fail where everything must run (tests/support/prerequisites.py).

Node metadata is per database in Citus, so `create_database` makes the database on every node,
creates the extension in each and registers the workers with the coordinator in it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import asyncpg

from tests.support.pgserver import PostgresUnavailable, ThrowawayPostgres, find_bindir

WORKERS = 2
HOST = "127.0.0.1"
# Citus commits a transaction that wrote on several nodes with two-phase commit, which needs
# prepared transactions on every node; the rest keeps three servers small on a shared machine.
_CITUS_SETTINGS = {
    "shared_preload_libraries": "citus",
    "max_prepared_transactions": "50",
    "max_connections": "60",
    "shared_buffers": "16MB",
    # A test that kills a worker wants the coordinator to notice within seconds, not minutes.
    "citus.node_connection_timeout": "3000",
    # Loopback only: no TLS between the nodes (libpq would otherwise look for client
    # certificates in the home directory of whoever started the tests).
    "citus.node_conninfo": "sslmode=disable",
}


class CitusUnavailable(RuntimeError):
    """Citus is not installed next to the PostgreSQL binaries, or the cluster did not start."""


def citus_installed(bindir: Path) -> bool:
    """Whether `citus.so` sits in the server's library directory (Debian's layout: `lib` next
    to `bin`, which is where ../shared/citus/install puts it)."""
    return (bindir.parent / "lib" / "citus.so").is_file()


class CitusCluster:
    """`start()` the three servers, `create_database(name)`, `destroy()`."""

    def __init__(self) -> None:
        bindir = find_bindir()
        if not citus_installed(bindir):
            raise CitusUnavailable(
                f"Citus is not installed for the PostgreSQL in {bindir}"
                " (run ../shared/citus/install as root)"
            )
        self.coordinator = ThrowawayPostgres(settings=_CITUS_SETTINGS)
        self.workers = [ThrowawayPostgres(settings=_CITUS_SETTINGS) for _ in range(WORKERS)]

    @property
    def nodes(self) -> list[ThrowawayPostgres]:
        return [self.coordinator, *self.workers]

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
        except PostgresUnavailable as exc:
            raise CitusUnavailable(str(exc)) from exc

    def destroy(self) -> None:
        for node in self.nodes:
            node.destroy()

    def dsn(self, database: str) -> str:
        """The coordinator's DSN for `database`: what a proxy connects to."""
        return self.coordinator.dsn(database)

    async def create_database(self, name: str) -> str:
        """A database with the extension on every node and both workers in its metadata."""
        for node in self.nodes:
            await node.execute(f'CREATE DATABASE "{name}"')
            conn = await asyncpg.connect(node.dsn(name))
            try:
                await conn.execute("CREATE EXTENSION IF NOT EXISTS citus")
            finally:
                await conn.close()
        conn = await asyncpg.connect(self.dsn(name))
        try:
            await conn.execute(
                "SELECT citus_set_coordinator_host($1, $2)", HOST, self.coordinator.port
            )
            for worker in self.workers:
                await conn.execute("SELECT citus_add_node($1, $2)", HOST, worker.port)
        finally:
            await conn.close()
        return self.dsn(name)

    async def drop_database(self, name: str) -> None:
        for node in reversed(self.nodes):
            with contextlib.suppress(asyncpg.PostgresError, OSError):
                await node.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
