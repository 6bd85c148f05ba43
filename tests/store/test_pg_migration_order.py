"""Migrations 0007 (HOT completion: `sweep_after`) and 0008 (evidence on attempts, SPEC §3.6)
applied in that order to a database that holds jobs of every state, as an upgrade from a store
at 0006 finds it: every job keeps what SPEC says of it, and an `unknown` job of before the
upgrade can be asked about and sent again (its window counted from its attempt's start)."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import pytest

from idemproxy.core.resolution import Backoff
from idemproxy.core.types import JobState
from idemproxy.store.postgres.store import Connections, PostgresStore
from idemproxy.store.queries import load_migrations, statements

pytestmark = pytest.mark.postgres

_BEFORE = ("0001", "0002", "0003", "0004", "0005", "0006")
_IDS = {state: str(uuid.uuid4()) for state in ("completed", "released", "in_flight", "unknown")}
_POPULATE = f"""
INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, state, version,
                            completed_by, response_status, response_body, expires_at,
                            lease_expires_at)
VALUES ('acme', 'completed', '{_IDS["completed"]}', 'f', 'POST', '/pay', 'completed', 2, 1, 201,
        '\\x7b7d', now() + interval '1 day', NULL),
       ('acme', 'released', '{_IDS["released"]}', 'f', 'POST', '/pay', 'released', 2, NULL, NULL,
        NULL, now() + interval '1 day', NULL),
       ('acme', 'in_flight', '{_IDS["in_flight"]}', 'f', 'POST', '/pay', 'in_flight', 1, NULL,
        NULL, NULL, now() + interval '1 day', now() + interval '1 minute'),
       ('acme', 'unknown', '{_IDS["unknown"]}', 'f', 'POST', '/pay', 'unknown', 2, NULL, NULL,
        NULL, now() + interval '1 day', NULL);
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, state, status, error,
                                started_at, finished_at, lease_expires_at)
VALUES ('acme', '{_IDS["completed"]}', 1, 'http://up', 'succeeded', 201, NULL,
        now() - interval '2 seconds', now() - interval '1 second', NULL),
       ('acme', '{_IDS["released"]}', 1, 'http://up', 'failed', 503, NULL,
        now() - interval '2 seconds', now() - interval '1 second', NULL),
       ('acme', '{_IDS["in_flight"]}', 1, 'http://up', 'started', NULL, NULL,
        now() - interval '1 second', NULL, now() + interval '1 minute'),
       ('acme', '{_IDS["unknown"]}', 1, 'http://up', 'unknown', NULL, 'timeout',
        now() - interval '2 seconds', now() - interval '1 second', NULL);
"""


@pytest.fixture
async def old_store(pg_server_dsn: str) -> AsyncIterator[str]:
    """A database of its own, migrated up to 0006 and populated; dropped afterwards."""
    name = f"idemproxy_test_order_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = urlsplit(pg_server_dsn)._replace(path=f"/{name}").geturl()
        conn = await asyncpg.connect(dsn)
        try:
            await _migrate_up_to_0006(conn)
            await conn.execute(_POPULATE)
        finally:
            await conn.close()
        yield dsn
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def _migrate_up_to_0006(conn: asyncpg.Connection) -> None:
    await conn.execute(
        "CREATE SCHEMA idemproxy; CREATE TABLE idemproxy.schema_migrations ("
        " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for version, sql in load_migrations("postgres"):
        if version.startswith(_BEFORE):
            for statement in statements(sql):
                await conn.execute(statement)
            await conn.execute("INSERT INTO idemproxy.schema_migrations VALUES ($1)", version)


async def test_0007_then_0008_on_a_populated_store(old_store: str) -> None:
    store = PostgresStore(old_store, connections=Connections(1, 2), listen=False)
    await store.open()
    try:
        applied = await store.migrate()
        assert applied[:2] == ["0007_hot_completion", "0008_attempt_evidence"]
        await _every_job_as_before(old_store)
        unknown = await store.get_by_id(_IDS["unknown"])
        assert unknown is not None and unknown.state is JobState.UNKNOWN
        (attempt,) = unknown.attempts
        assert (attempt.checks, attempt.checked_at, attempt.evidence) == (0, None, ())
        # SPEC §3.6 on the job of before the upgrade: due, asked once, sent again in its window.
        first = Backoff(0.0, 0.0, 0.0)
        (due,) = await store.due_unknown(first, after=str(uuid.UUID(int=0)), limit=10)
        assert due.id == unknown.id
        assert await store.claim_check(unknown, 1, checks=0, due_after=0)
        resent = await store.resend(
            unknown, 1, "http://up", window=60, lease=30, token=str(uuid.uuid4())
        )
        assert resent is not None and resent.attempt == 2
        assert resent.job.state is JobState.IN_FLIGHT
    finally:
        await store.close()


async def _every_job_as_before(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT key, state, sweep_after IS NOT DISTINCT FROM expires_at AS at_expiry,"
            " sweep_after IS NULL AS unswept FROM idemproxy.jobs ORDER BY key"
        )
        # SPEC §3.1: an unknown job is never swept; every other keeps its expiry.
        assert [tuple(row) for row in rows] == [
            ("completed", "completed", True, False),
            ("in_flight", "in_flight", True, False),
            ("released", "released", True, False),
            ("unknown", "unknown", False, True),
        ]
        checks = await conn.fetch("SELECT checks, evidence, sent_digest FROM idemproxy.attempts")
        assert {tuple(row) for row in checks} == {(0, None, None)}
    finally:
        await conn.close()
