"""Migration 0009 on a store that already holds the jobs its predecessor left: a job caught in the
lease scan's gap (in flight, every attempt ended, SPEC §3.5) is found again, and the attempts of
jobs that ended keep no lease.

The jobs are written as the statements before 0009 left them; then the migration runs again
(it rebuilds the scan's index, and its updates only touch such rows)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from idemproxy.store.queries import load_migrations, load_queries, statements

pytestmark = pytest.mark.postgres

_MIGRATION = "0009"
_JOBS = """
INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, state, attempt_count,
                            expires_at, sweep_after, lease_expires_at)
VALUES ('acme', 'gap', $1, 'f', 'POST', '/pay', 'in_flight', 2, now() + interval '1 day',
        now() + interval '1 day', now() - interval '1 minute'),
       ('acme', 'settled', $2, 'f', 'POST', '/pay', 'unknown', 2, now() + interval '1 day',
        NULL, NULL)
"""
# The gap: both racers ended by `finish_attempt`, which cleared their leases. The settled job:
# its second racer was still running when the first settled it.
_ATTEMPTS = """
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, state, finished_at,
                                lease_expires_at)
VALUES ('acme', $1, 1, 'a', 'failed', now(), NULL),
       ('acme', $1, 2, 'b', 'unknown', now(), NULL),
       ('acme', $2, 1, 'a', 'unknown', now(), NULL),
       ('acme', $2, 2, 'b', 'started', NULL, now() - interval '1 minute')
"""


@pytest.fixture
async def conn(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def test_the_migration_heals_the_gap_and_clears_ended_jobs(conn: asyncpg.Connection) -> None:
    gap, settled = uuid.uuid4(), uuid.uuid4()
    await conn.execute(_JOBS, gap, settled)
    await conn.execute(_ATTEMPTS, gap, settled)

    (sql,) = [sql for version, sql in load_migrations("postgres") if version.startswith(_MIGRATION)]
    async with conn.transaction():
        for statement in statements(sql):
            await conn.execute(statement)

    leased = await conn.fetch(
        "SELECT job_id, number, a.lease_expires_at = j.lease_expires_at AS the_jobs"
        " FROM idemproxy.attempts a JOIN idemproxy.jobs j ON j.owner = a.owner AND j.id = a.job_id"
        " WHERE a.lease_expires_at IS NOT NULL"
    )
    assert [tuple(row) for row in leased] == [(gap, 2, True)]
    # The background takeover finds it again, a minute past its lease.
    found = await conn.fetch(load_queries("postgres")["expired_leases"], 30.0, 10)
    assert [row["id"] for row in found] == [gap]
