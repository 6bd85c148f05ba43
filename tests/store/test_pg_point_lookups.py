"""Every hot statement is a point lookup whatever the planner's statistics say.

A store that was never analyzed (a fresh, restored or bulk-loaded database; a server without
autovacuum) gives the planner nothing to tell two indexes apart by. A generic plan made while
the table was small is kept while the table grows (only an ANALYZE or a schema change replaces
it): with `UNIQUE (owner, id)` next to the `(owner, key)` primary key, the claim's generic plan
took the former with `key` as a filter, and a new key read every job of its owner.

Each statement is prepared on the empty tables, its generic plan made there (as a connection of
a fresh store makes it), then 100,000 jobs of one owner are bulk-loaded, never analyzed, and the
same plan runs: every scan must be an index scan that reads no row it does not return, within a
few blocks.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from idemproxy.core.quota import window_start_id
from idemproxy.store.queries import load_queries

pytestmark = pytest.mark.postgres

_JOBS = 100_000
# A point lookup per statement reads a handful of blocks (B-tree descents, the heap page, the
# index entries it writes); a scan of one owner's 100,000 jobs reads hundreds.
_MOST_BLOCKS = 120
_SQL = load_queries("postgres")
# Time-ordered ids (UUIDv7, identity/intent.py) from before the quotas' rate window, as the
# proxy makes them: the old jobs' from a day ago, one millisecond apart, the live ones' older.
_LIVE = ("018f0000-0000-7111-8111-111111111111", "018f0000-0000-7222-8222-222222222222")
_OLD_ID = (
    "(lpad(to_hex((extract(epoch FROM now() - interval '1 day') * 1000)::bigint + g), 12, '0')"
    " || '7' || lpad(to_hex(g), 19, '0'))::uuid"
)

_LOAD = f"""
INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, state, version,
                            completed_by, response_status, response_body, expires_at, sweep_after)
SELECT 'acme', 'old-' || g, {_OLD_ID}, 'f', 'POST', '/pay', 'completed', 2, 1, 201,
       '\\x7b7d', now() + interval '1 day', now() + interval '1 day'
FROM generate_series(1, {_JOBS}) g;
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, state, status, finished_at)
SELECT owner, id, 1, 'a', 'succeeded', 201, now() FROM idemproxy.jobs;
INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, expires_at,
                            sweep_after, lease_expires_at)
VALUES ('acme', 'live-0', '{_LIVE[0]}', 'f', 'POST', '/pay', now() + interval '1 day',
        now() + interval '1 day', now() + interval '1 minute'),
       ('acme', 'live-1', '{_LIVE[1]}', 'f', 'POST', '/pay', now() + interval '1 day',
        now() + interval '1 day', now() + interval '1 minute');
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
SELECT owner, id, 1, 'a', lease_expires_at FROM idemproxy.jobs WHERE key LIKE 'live-%';
"""


def _new_id() -> str:
    return str(uuid.uuid4())


def _array(values: list[str], kind: str) -> str:
    return "ARRAY[" + ", ".join(values) + f"]::{kind}[]"


def _statements() -> dict[str, str]:
    """The hot statements and their arguments (SQL literals): new keys, and the two jobs in
    flight."""
    live = [f"'{job}'" for job in _LIVE]
    return {
        "claim": f"'acme', 'new-0', '{_new_id()}', 'f', 'POST', '/pay', 60, 'a', 30",
        "claim_batch": ", ".join(
            [
                "'acme'",
                _array(["'new-1'", "'new-2'", "'old-7'"], "text"),
                _array([f"'{_new_id()}'" for _ in range(3)], "uuid"),
                _array(["'f'"] * 3, "text"),
                _array(["'POST'"] * 3, "text"),
                _array(["'/pay'"] * 3, "text"),
                _array(["60"] * 3, "float8"),
                _array(["'a'"] * 3, "text"),
                _array(["30"] * 3, "float8"),
            ]
        ),
        "get_job": "'acme', 'old-500'",
        "watch_job": "'acme', 'live-0'",
        "complete": f"'acme', {live[0]}, 1, 1, 201, NULL, '\\x7b7d', false, 60, 1048576, NULL, "
        "'live-0'",
        "complete_sole": f"'acme', {live[0]}, 1, 1, 201, NULL, '\\x7b7d', false, 60, NULL, "
        "'live-0'",
        "renew_lease": f"'acme', {live[0]}, 1, 30, 'live-0'",
        "settle": f"'acme', {live[0]}, 1, 1, 'released', 'failed', NULL, 'refused', 'live-0'",
    }


@pytest.fixture
async def conn(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A session on a fresh store whose tables are never analyzed (autovacuum off for them)."""
    conn = await asyncpg.connect(pg_dsn)
    tables = ("idemproxy.jobs", "idemproxy.attempts")
    try:
        for table in tables:
            await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        yield conn
    finally:
        for table in tables:
            await conn.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")
        await conn.close()


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


def _blocks(node: dict[str, Any]) -> int:
    return int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))


def _wasted(plan: dict[str, Any]) -> list[str]:
    """What in an executed plan is not a point lookup: a sequential scan of a table, a scan that
    read rows it then filtered out, or too many blocks read."""
    found = []
    for node in _nodes(plan):
        kind, relation = node["Node Type"], node.get("Relation Name")
        if kind == "Seq Scan" and relation in ("jobs", "attempts"):
            found.append(f"Seq Scan on {relation}")
        if node.get("Rows Removed by Filter", 0) > 0 and relation in ("jobs", "attempts"):
            index, removed = node.get("Index Name"), node["Rows Removed by Filter"]
            found.append(f"{kind} on {relation} ({index}) filtered {removed}")
        if _blocks(node) > _MOST_BLOCKS:
            found.append(f"{kind} read {_blocks(node)} blocks")
    return found


async def _executed(conn: asyncpg.Connection, name: str, args: str) -> dict[str, Any]:
    """The prepared statement's cached generic plan, run (and rolled back)."""
    call = f"{name}({args})" if args else name
    explain = f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {call}"
    tx = conn.transaction()
    await tx.start()
    try:
        document = await conn.fetchval(explain)
    finally:
        await tx.rollback()
    plan: dict[str, Any] = json.loads(document)[0]["Plan"]
    return plan


async def _wasted_plans(conn: asyncpg.Connection, statements: dict[str, str]) -> str:
    """What each prepared statement's cached plan wastes, one line per statement that does."""
    lines = []
    for name, args in statements.items():
        found = _wasted(await _executed(conn, name, args))
        if found:
            lines.append(f"{name}: {found}")
    return "\n".join(lines)


async def _prepared(conn: asyncpg.Connection, statements: dict[str, str]) -> None:
    """Each statement prepared afresh, its generic plan made now (and cached)."""
    prepared = {r["name"] for r in await conn.fetch("SELECT name FROM pg_prepared_statements")}
    for name, args in statements.items():
        if name in prepared:
            await conn.execute(f"DEALLOCATE {name}")
        await conn.execute(f"PREPARE {name} AS {_SQL[name]}")
        await _executed(conn, name, args)


async def test_hot_statements_stay_point_lookups_on_an_unanalyzed_store(
    conn: asyncpg.Connection,
) -> None:
    statements = _statements()
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    await _prepared(conn, statements)  # the generic plans, made on the empty tables
    await conn.execute(_LOAD)
    stats = await conn.fetchval("SELECT count(*) FROM pg_stats WHERE schemaname = 'idemproxy'")
    assert stats == 0, "the tables must be unanalyzed"
    assert await _wasted_plans(conn, statements) == ""
    await _prepared(conn, statements)  # made on the loaded, unanalyzed tables
    assert await _wasted_plans(conn, statements) == ""
    await conn.execute("ANALYZE idemproxy.jobs, idemproxy.attempts")
    await _prepared(conn, statements)  # and with statistics
    assert await _wasted_plans(conn, statements) == ""


def _ran(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The nodes that ran: a part whose arguments skip it (a CASE branch) reads nothing."""
    return (node for node in _nodes(plan) if node.get("Actual Loops", 1) > 0)


def _beyond_live_jobs(plan: dict[str, Any]) -> list[str]:
    """What in an executed plan reads more than the owner's live jobs (_LIVE): a sequential
    scan, a scan that returned more rows than those or read rows it then filtered out, or more
    blocks in all than a few lookups read."""
    found = []
    for node in _ran(plan):
        kind, relation = node["Node Type"], node.get("Relation Name")
        if relation not in ("jobs", "attempts"):
            continue
        rows = node["Actual Rows"] * node["Actual Loops"]
        removed = node.get("Rows Removed by Filter", 0)
        if kind == "Seq Scan" or rows > len(_LIVE) or removed:
            index = node.get("Index Name")
            found.append(f"{kind} on {relation} ({index}): {rows} rows, {removed} filtered out")
    if _blocks(plan) > _MOST_BLOCKS:
        found.append(f"{_blocks(plan)} blocks")
    return found


async def _reads_only_live_jobs(conn: asyncpg.Connection, args: str) -> list[str]:
    """What the prepared `quota_usage`'s cached plan reads beyond the live jobs; and it counts
    those."""
    usage = await conn.fetchrow(f"EXECUTE quota_usage({args})")
    assert usage is not None
    assert (usage["taken"], usage["in_flight"], usage["recent"]) == (False, len(_LIVE), 0)
    return _beyond_live_jobs(await _executed(conn, "quota_usage", args))


async def test_the_quota_count_reads_only_the_owners_live_jobs(conn: asyncpg.Connection) -> None:
    """SPEC §9: a new key under `max_in_flight` or `max_new_per_second` counts the owner's jobs
    in flight and those of the rate window, never its other jobs, whichever generic plan the
    statement keeps. The stored-bytes limit reads every job of the owner by design
    (docs/operations.md): its parts do not run without it ($4)."""
    statement = {"quota_usage": f"'acme', 'new-0', '{window_start_id()}', false"}
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    await _prepared(conn, statement)  # the generic plan, made on the empty tables
    await conn.execute(_LOAD)
    stats = await conn.fetchval("SELECT count(*) FROM pg_stats WHERE schemaname = 'idemproxy'")
    assert stats == 0, "the tables must be unanalyzed"
    assert await _reads_only_live_jobs(conn, statement["quota_usage"]) == []
    await _prepared(conn, statement)  # made on the loaded, unanalyzed tables
    assert await _reads_only_live_jobs(conn, statement["quota_usage"]) == []
    await conn.execute("ANALYZE idemproxy.jobs, idemproxy.attempts")
    await _prepared(conn, statement)  # and with statistics
    assert await _reads_only_live_jobs(conn, statement["quota_usage"]) == []


# The housekeeping and operators' statements, with the index each must keep (SPEC §11, §3.3, §3.5):
# one of those named (a lookup by id may take either index of `(id, owner)`, `(owner, id)`).
_BY_ID = ("jobs_id_owner_key", "jobs_owner_id_idx")
_HOUSEKEEPING = {
    "expired_leases": ("0, 100", ("attempts_lease_idx",)),
    "sweep_expired": ("500", ("jobs_sweep_idx",)),
    "stale_unknown": ("0, 100", ("jobs_unknown_idx",)),
    "count_unknown": ("", ("jobs_unknown_idx",)),
    # SPEC §3.6: the reconciler's pages of due unknown jobs, and its right to ask about one.
    "due_unknown": ("0, 0, 0, '00000000-0000-0000-0000-000000000000', 100", ("jobs_unknown_idx",)),
    "claim_check": (f"'acme', '{_LIVE[0]}', 1, 1, 0, 0", ("attempts_pkey",)),
    "take_over": (f"'acme', '{_LIVE[0]}', 1", _BY_ID),
    "resolve_completed": (
        f"'acme', '{_LIVE[0]}', 1, 'operator', 201, NULL, '\\x7b7d', 60, NULL",
        _BY_ID,
    ),
    "resolve_released": (f"'acme', '{_LIVE[0]}', 1, 'operator'", _BY_ID),
    "get_job_by_id": (f"'{_LIVE[0]}'", ("jobs_id_owner_key",)),
    "owner_jobs": (
        "'acme', '00000000-0000-0000-0000-000000000000', now(), 100",
        ("jobs_owner_id_idx",),
    ),
    "quota_usage": (
        "'acme', 'new-0', '00000000-0000-0000-0000-000000000000', true",
        ("jobs_owner_id_idx",),
    ),
    "get_attempts": (f"'acme', '{_LIVE[0]}'", ("attempts_pkey",)),
}


async def _index_paths(conn: asyncpg.Connection) -> dict[str, set[str]]:
    """The indexes each housekeeping statement's cached plan used; no sequential scan."""
    used = {}
    for name, (args, _) in _HOUSEKEEPING.items():
        plan = await _executed(conn, name, args)
        used[name] = {str(node["Index Name"]) for node in _nodes(plan) if "Index Name" in node}
        scans = [n for n in _nodes(plan) if n["Node Type"] == "Seq Scan"]
        assert not scans, f"{name}: {[n.get('Relation Name') for n in scans]}"
    return used


def _without_their_index(used: dict[str, set[str]]) -> dict[str, set[str]]:
    return {
        name: used[name] for name, (_, kept) in _HOUSEKEEPING.items() if not used[name] & set(kept)
    }


async def test_housekeeping_keeps_an_index_path(conn: asyncpg.Connection) -> None:
    statements = {name: args for name, (args, _) in _HOUSEKEEPING.items()}
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    await _prepared(conn, statements)  # the generic plans, made on the empty tables
    await conn.execute(_LOAD)
    assert _without_their_index(await _index_paths(conn)) == {}
    await conn.execute("RESET plan_cache_mode")
    await _prepared(conn, statements)  # planned for their arguments, on the unanalyzed tables
    assert _without_their_index(await _index_paths(conn)) == {}
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    await _prepared(conn, statements)  # and as generic plans
    assert _without_their_index(await _index_paths(conn)) == {}


# A store that already holds a few hundred jobs when a connection makes its plans: jobs and
# attempts a few pages long, which a scan reads for less than ten index descents cost.
_EARLY = """
INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, state, version,
                            completed_by, response_status, response_body, expires_at, sweep_after)
SELECT 'acme', 'early-' || g, gen_random_uuid(), 'f', 'POST', '/pay', 'completed', 2, 1, 201,
       '\\x7b7d', now() + interval '1 day', now() + interval '1 day'
FROM generate_series(1, {count}) g;
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, state, status, finished_at)
SELECT owner, id, 1, 'a', 'succeeded', 201, now() FROM idemproxy.jobs;
"""
_LOAD_AFTER_EARLY = _LOAD.replace(
    "FROM idemproxy.jobs;", "FROM idemproxy.jobs WHERE key LIKE 'old-%';", 1
)


@pytest.mark.parametrize("early", [300, 1_000])
async def test_plans_made_on_a_small_store_stay_point_lookups(
    conn: asyncpg.Connection, early: int
) -> None:
    """With 300 or 1,000 jobs, a statement over arrays joined to the tables (the completions'
    batch was one) took scans of both; every statement here keeps its point lookups. A batch of
    completions runs `complete` once per completion (store/postgres/store.py)."""
    await conn.execute(_EARLY.format(count=early))
    statements = _statements()
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    await _prepared(conn, statements)  # the generic plans, made on the small store
    await conn.execute(_LOAD_AFTER_EARLY)
    assert await _wasted_plans(conn, statements) == ""
