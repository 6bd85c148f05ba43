"""The job's changes on the way of a new key update it in place (HOT, migration 0007), and the
housekeeping that no longer reads the columns they change still finds what SPEC says it finds:
the sweep (§11, ttl counted from the completion), the unknown jobs (§3.3) and the jobs whose
lease ran out (§3.5).

The statements run as the store sends them (queries.sql), on one connection, so that the
transaction's own statistics (`pg_stat_xact_user_tables`) count their updates.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from idemproxy.store.queries import load_queries

pytestmark = pytest.mark.postgres

_SQL = load_queries("postgres")
_OWNER = "acme"
_UPDATES = """
SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables
WHERE relid = 'idemproxy.jobs'::regclass
"""


@pytest.fixture
async def conn(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def _claim(
    conn: asyncpg.Connection, key: str, *, ttl: float = 60.0, lease: float = 30.0
) -> uuid.UUID:
    row = await conn.fetchrow(
        _SQL["claim"], _OWNER, key, uuid.uuid4(), "fp", "POST", "/pay", ttl, "http://up", lease
    )
    assert row is not None and row["created"]
    job: uuid.UUID = row["id"]
    return job


async def _complete(conn: asyncpg.Connection, key: str, job: uuid.UUID, *, ttl: float) -> None:
    won = await conn.fetch(
        _SQL["complete"], _OWNER, job, 1, 1, 201, None, b"{}", False, ttl, 1 << 20, None, key
    )
    assert len(won) == 1


async def _settle(conn: asyncpg.Connection, key: str, job: uuid.UUID, state: str) -> None:
    attempt = "failed" if state == "released" else "unknown"
    settled = await conn.fetch(_SQL["settle"], _OWNER, job, 1, 1, state, attempt, None, "test", key)
    assert len(settled) == 1


async def test_a_new_keys_renewal_completion_and_release_are_hot(
    conn: asyncpg.Connection,
) -> None:
    async with conn.transaction():
        job = await _claim(conn, "done")
        assert await conn.fetch(_SQL["renew_lease"], _OWNER, job, 1, 30.0, "done")
        await _complete(conn, "done", job, ttl=60.0)
        await _settle(conn, "released", await _claim(conn, "released"), "released")
        updates = await conn.fetchrow(_UPDATES)
    assert updates is not None
    assert (updates["n_tup_upd"], updates["n_tup_hot_upd"]) == (3, 3)


async def _complete_sole(
    conn: asyncpg.Connection, key: str, job: uuid.UUID, *, version: int = 1
) -> list[asyncpg.Record]:
    won: list[asyncpg.Record] = await conn.fetch(
        _SQL["complete_sole"], _OWNER, job, version, 1, 201, None, b"{}", False, 60.0, None, key
    )
    return won


async def _attempts(conn: asyncpg.Connection, job: uuid.UUID) -> list[tuple[str, bool]]:
    """(state, whether it holds a lease) of each attempt of `job`, in order."""
    rows = await conn.fetch(
        "SELECT state, lease_expires_at IS NOT NULL AS leased FROM idemproxy.attempts"
        " WHERE owner = $1 AND job_id = $2 ORDER BY number",
        _OWNER,
        job,
    )
    return [(row["state"], row["leased"]) for row in rows]


async def test_a_new_keys_sole_completion_is_hot_and_ends_its_attempt(
    conn: asyncpg.Connection,
) -> None:
    async with conn.transaction():
        job = await _claim(conn, "sole")
        won = await _complete_sole(conn, "sole", job)
        updates = await conn.fetchrow(_UPDATES)
    assert [(row["watched"], row["notified"]) for row in won] == [(False, None)]
    assert updates is not None
    assert (updates["n_tup_upd"], updates["n_tup_hot_upd"]) == (1, 1)
    stored = await conn.fetchrow(
        "SELECT state, version, completed_by, response_status, lease_expires_at"
        " FROM idemproxy.jobs WHERE owner = $1 AND key = 'sole'",
        _OWNER,
    )
    assert stored is not None
    assert tuple(stored) == ("completed", 2, 1, 201, None)
    assert await _attempts(conn, job) == [("succeeded", False)]


async def test_the_sole_completion_changes_nothing_it_does_not_win(
    conn: asyncpg.Connection,
) -> None:
    # A job with a second attempt (a hedge the completing caller had not seen), and a stale
    # version: no row, nothing changed; the store then sends `complete`, which decides.
    hedged = await _claim(conn, "hedged")
    assert await conn.fetch(_SQL["add_attempt"], _OWNER, hedged, 1, "http://other", 30.0)
    assert await _complete_sole(conn, "hedged", hedged) == []
    stale = await _claim(conn, "stale")
    assert await _complete_sole(conn, "stale", stale, version=2) == []
    states = await conn.fetch(
        "SELECT key, state, version FROM idemproxy.jobs WHERE owner = $1 ORDER BY key", _OWNER
    )
    assert [tuple(row) for row in states] == [("hedged", "in_flight", 1), ("stale", "in_flight", 1)]
    assert await _attempts(conn, hedged) == [("started", True), ("started", True)]
    assert await _attempts(conn, stale) == [("started", True)]


async def _keys(conn: asyncpg.Connection) -> set[str]:
    return {row["key"] for row in await conn.fetch("SELECT key FROM idemproxy.jobs")}


async def _age(conn: asyncpg.Connection, key: str, seconds: float) -> None:
    """The job as if claimed `seconds` earlier: its claim's expiry and lease moved back."""
    shift = "make_interval(secs => $2)"
    await conn.execute(
        f"UPDATE idemproxy.jobs SET created_at = created_at - {shift},"
        f" expires_at = expires_at - {shift}, sweep_after = sweep_after - {shift},"
        f" lease_expires_at = lease_expires_at - {shift} WHERE key = $1",
        key,
        seconds,
    )
    await conn.execute(
        f"UPDATE idemproxy.attempts SET lease_expires_at = lease_expires_at - {shift}"
        " WHERE job_id = (SELECT id FROM idemproxy.jobs WHERE key = $1)",
        key,
        seconds,
    )


async def test_the_sweep_counts_ttl_from_the_completion(conn: asyncpg.Connection) -> None:
    # Both claimed with a ttl of 60 s, 120 s ago, completed now: one with 60 s (SPEC §11: kept
    # 60 s from now), one with 1 ms (expired at once, though its claim's expiry was later).
    for key in ("kept", "short"):
        await _claim(conn, key, ttl=60.0)
        await _age(conn, key, 120.0)
    kept = await conn.fetchval("SELECT id FROM idemproxy.jobs WHERE key = 'kept'")
    short = await conn.fetchval("SELECT id FROM idemproxy.jobs WHERE key = 'short'")
    await _complete(conn, "kept", kept, ttl=60.0)
    await _claim(conn, "fresh-short", ttl=3600.0)
    fresh = await conn.fetchval("SELECT id FROM idemproxy.jobs WHERE key = 'fresh-short'")
    await _complete(conn, "fresh-short", fresh, ttl=0.001)
    await _complete(conn, "short", short, ttl=0.001)
    await conn.execute("SELECT pg_sleep(0.01)")
    await conn.execute(_SQL["sweep_expired"], 100)
    assert await _keys(conn) == {"kept"}


async def test_unknown_jobs_are_listed_counted_and_never_swept(conn: asyncpg.Connection) -> None:
    job = await _claim(conn, "unknown", ttl=60.0)
    await _settle(conn, "unknown", job, "unknown")
    await _age(conn, "unknown", 120.0)  # past the claim's expiry, the only one it has
    await conn.execute("UPDATE idemproxy.jobs SET updated_at = updated_at - interval '2 minutes'")
    assert await conn.fetchval(_SQL["count_unknown"]) == 1
    stale = await conn.fetch(_SQL["stale_unknown"], 60.0, 10)
    assert [row["key"] for row in stale] == ["unknown"]
    await conn.execute(_SQL["sweep_expired"], 100)
    assert await _keys(conn) == {"unknown"}
    # Released by an operator: the expiry it had, so the sweep takes it.
    assert await conn.fetch(_SQL["resolve_released"], _OWNER, job, 2, "operator")
    assert await conn.fetchval(_SQL["count_unknown"]) == 0
    await conn.execute(_SQL["sweep_expired"], 100)
    assert await _keys(conn) == set()


async def test_a_resolved_job_is_kept_for_its_ttl_from_the_resolution(
    conn: asyncpg.Connection,
) -> None:
    job = await _claim(conn, "resolved", ttl=60.0)
    await _settle(conn, "resolved", job, "unknown")
    await _age(conn, "resolved", 120.0)
    resolved = await conn.fetch(
        _SQL["resolve_completed"], _OWNER, job, 2, "operator", 200, None, b"{}", 60.0, None
    )
    assert resolved
    await conn.execute(_SQL["sweep_expired"], 100)
    assert await _keys(conn) == {"resolved"}


async def test_the_lease_scan_reads_the_lease_as_renewed(conn: asyncpg.Connection) -> None:
    # Three jobs whose attempts started with a lease that ran out 60 s ago: one renewed since
    # (alive), one hedged with a second attempt (found once), one completed (not in flight).
    for key in ("renewed", "hedged", "done"):
        await _claim(conn, key, lease=30.0)
        await _age(conn, key, 90.0)
    ids = {row["key"]: row["id"] for row in await conn.fetch("SELECT key, id FROM idemproxy.jobs")}
    renewed, hedged, done = ids["renewed"], ids["hedged"], ids["done"]
    assert await conn.fetch(_SQL["renew_lease"], _OWNER, renewed, 1, 30.0, "renewed")
    await conn.fetch(_SQL["add_attempt"], _OWNER, hedged, 1, "http://other", -90.0)
    await _complete(conn, "done", done, ttl=60.0)
    orphans = await conn.fetch(_SQL["expired_leases"], 30.0, 10)
    assert [row["key"] for row in orphans] == ["hedged"]
    taken = await conn.fetch(_SQL["take_over"], _OWNER, hedged, 1)
    assert len(taken) == 1
    assert await conn.fetch(_SQL["expired_leases"], 30.0, 10) == []
    assert await conn.fetchval(_SQL["count_unknown"]) == 1


async def _leased(conn: asyncpg.Connection) -> set[tuple[str, int]]:
    """The attempts that hold a lease (the lease scan's index), as (job key, number)."""
    rows = await conn.fetch(
        "SELECT j.key, a.number FROM idemproxy.attempts a"
        " JOIN idemproxy.jobs j ON j.owner = a.owner AND j.id = a.job_id"
        " WHERE a.lease_expires_at IS NOT NULL"
    )
    return {(row["key"], row["number"]) for row in rows}


async def test_attempts_keep_their_lease_until_their_job_ends(conn: asyncpg.Connection) -> None:
    # Migration 0009: a racer ended alone keeps the lease it started with while its job is in
    # flight (the lease scan finds the job through it); each end of the job clears the leases of
    # all its attempts, so that the scan's index holds the jobs in flight alone.
    keys = ("completed", "batched", "settled", "taken", "running")
    ids = {}
    for key in keys:
        ids[key] = await _claim(conn, key, lease=30.0)
        assert await conn.fetch(_SQL["add_attempt"], _OWNER, ids[key], 1, "http://other", 30.0)
        await conn.execute(_SQL["finish_attempt"], _OWNER, ids[key], 1, "failed", 503, "busy")
    assert await _leased(conn) == {(key, number) for key in keys for number in (1, 2)}

    body, limit = b"{}", 1 << 20
    won = await conn.fetch(
        _SQL["complete"],
        _OWNER,
        ids["completed"],
        1,
        2,
        201,
        None,
        body,
        False,
        60.0,
        limit,
        None,
        "completed",
    )
    assert len(won) == 1
    # A batch of completions: `complete` run once per completion in one pipeline and commit.
    batch = await conn.fetchmany(
        _SQL["complete"],
        [(_OWNER, ids["batched"], 1, 2, 201, None, body, False, 60.0, limit, None, "batched")],
    )
    assert [row["id"] for row in batch] == [ids["batched"]]
    settled = await conn.fetch(
        _SQL["settle"], _OWNER, ids["settled"], 1, 2, "released", "failed", 503, "busy", "settled"
    )
    assert len(settled) == 1
    await _age(conn, "taken", 60.0)
    assert len(await conn.fetch(_SQL["take_over"], _OWNER, ids["taken"], 1)) == 1

    assert await _leased(conn) == {("running", 1), ("running", 2)}


async def test_an_attempt_that_ends_after_its_job_keeps_no_lease(conn: asyncpg.Connection) -> None:
    # A hedge added while the completion waited for the job's row: the completion's snapshot
    # does not hold it, so the completion leaves its lease. Ending it then clears it.
    job = await _claim(conn, "late-hedge")
    await _complete(conn, "late-hedge", job, ttl=60.0)
    await conn.execute(
        "INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)"
        " VALUES ($1, $2, 2, 'http://other', now() + interval '30 seconds')",
        _OWNER,
        job,
    )
    await conn.execute(_SQL["finish_attempt"], _OWNER, job, 2, "failed", 503, "busy")
    assert await _leased(conn) == set()
