"""The PostgreSQL store on a real Citus cluster (SPEC §11): how its statements are planned, how
`idemproxy migrate --distribute` distributes the tables, and what only a cluster can show (the
sweep across shards). The store contract itself runs on the cluster too (tests/store/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from idemproxy.core.quota import QuotaLimits
from idemproxy.core.types import Claimed, Existing, Intent, StoredResponse
from idemproxy.store.postgres.store import Connections, PostgresStore
from idemproxy.store.queries import load_migrations, load_queries
from tests.store.test_citus_routing import POSTGRES_HOT_PATH
from tests.support.citus import CitusCluster
from tests.support.stores import opened

pytestmark = pytest.mark.citus

JOB = uuid.UUID(int=1)
# Arguments for EXPLAIN of each statement on owner "alice" (EXPLAIN plans, never executes).
_ARGS: dict[str, tuple[Any, ...]] = {
    "claim": ("alice", "k", JOB, "fp", "POST", "/", 60.0, "primary", 30.0),
    "get_job": ("alice", "k"),
    "watch_job": ("alice", "k"),
    "complete": ("alice", JOB, 1, 1, 201, "[]", b"x", False, 60.0, 1024, None, "k"),
    "complete_sole": ("alice", JOB, 1, 1, 201, "[]", b"x", False, 60.0, None, "k"),
    "settle": ("alice", JOB, 1, 1, "released", "failed", 503, "e", "k"),
    "finish_attempt": ("alice", JOB, 1, "failed", 503, "e"),
    "start_next_attempt": ("alice", JOB, 1, "primary", 30.0, JOB),
    "fail_over": ("alice", JOB, 1, 1, 503, "e", "secondary", 30.0, JOB),
    "add_attempt": ("alice", JOB, 1, "secondary", 30.0),
    "renew_lease": ("alice", JOB, 1, 30.0, "k"),
    "take_over": ("alice", JOB, 1),
    "forget": ("alice", JOB, 1),
    "get_attempts": ("alice", JOB),
    "get_late_response": ("alice", JOB, 1),
    "resolve_completed": ("alice", JOB, 1, "operator", 200, "[]", b"x", 60.0, None),
    "resolve_released": ("alice", JOB, 1, "operator"),
    "delete_job": ("alice", JOB, 1, False),
    "claim_job_distributed": ("alice", "k", JOB, "fp", "POST", "/", 60.0, 30.0),
    "start_next_attempt_distributed": ("alice", JOB, 1, 30.0, JOB),
    "fail_over_distributed": ("alice", JOB, 1, 30.0, JOB),
    "add_attempt_distributed": ("alice", JOB, 1, 30.0),
    "add_attempt_row": ("alice", JOB, 2, "primary", datetime.now(UTC)),
    "quota_usage": ("alice", "k", JOB, True),
}
# The statements that insert an attempt from a CTE's rows: Citus plans them in steps through the
# coordinator, so on Citus the store runs their `…_distributed` forms (store/postgres/citus.py).
STEPPED = ("claim", "start_next_attempt", "fail_over", "add_attempt")
ROUTED = (
    *(name for name in POSTGRES_HOT_PATH if name not in STEPPED),
    *(f"{name}_distributed" for name in STEPPED if name != "claim"),
    "claim_job_distributed",
    "add_attempt_row",
    "get_attempts",
    "get_late_response",
    "resolve_completed",
    "resolve_released",
    "delete_job",
    "quota_usage",  # the quota claim's count (SPEC §9), in its transaction before the claim
)


def distributed_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """The Citus part of an EXPLAIN (FORMAT JSON) plan: its top node must be Citus's."""
    top = plan["Plan"]
    assert top.get("Custom Plan Provider") == "Citus Adaptive", top.get("Node Type")
    distributed: dict[str, Any] = top["Distributed Query"]
    return distributed


async def explain(dsn: str, name: str) -> dict[str, Any]:
    """The plan of queries.sql's statement `name` with _ARGS[name] bound, as Citus makes it."""
    conn = await asyncpg.connect(dsn)
    try:
        sql = load_queries("postgres")[name]
        [plan] = json.loads(await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *_ARGS[name]))
    finally:
        await conn.close()
    return distributed_plan(plan)


@pytest.mark.parametrize("name", ROUTED)
async def test_each_hot_path_statement_is_a_router_query_on_one_shard(
    citus_dsn: str, name: str
) -> None:
    distributed = await explain(citus_dsn, name)
    # No subplan (a part Citus runs first and ships around), and one task on one worker.
    assert "Subplans" not in distributed, json.dumps(distributed)[:2000]
    assert distributed["Job"]["Task Count"] == 1, json.dumps(distributed)[:2000]


@pytest.mark.parametrize("name", STEPPED)
async def test_the_single_statement_forms_are_not_router_queries_on_citus(
    citus_dsn: str, name: str
) -> None:
    """Why the store runs the `…_distributed` forms on Citus: these are refused or planned as
    several steps (subplans whose rows go through the coordinator)."""
    try:
        distributed = await explain(citus_dsn, name)
    except asyncpg.FeatureNotSupportedError:
        return  # "could not create distributed plan"
    assert "Subplans" in distributed or "Job" not in distributed, json.dumps(distributed)[:2000]


async def test_the_sweep_reads_every_shard(citus_dsn: str) -> None:
    conn = await asyncpg.connect(citus_dsn)
    try:
        sql = load_queries("postgres")["sweep_expired_distributed"]
        [plan] = json.loads(await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", 10))
        shards = await conn.fetchval(
            "SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'idemproxy.jobs'::regclass"
        )
    finally:
        await conn.close()
    assert distributed_plan(plan)["Job"]["Task Count"] == shards > 1


async def _jobs_per_worker(cluster: CitusCluster, dsn: str) -> dict[int, int]:
    """Rows of `idemproxy.jobs` on each worker, counted on the workers' shards themselves."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT nodeport, result::int AS jobs FROM run_command_on_shards("
            "'idemproxy.jobs', 'SELECT count(*) FROM %s') r"
            " JOIN pg_dist_shard_placement p USING (shardid)"
        )
    finally:
        await conn.close()
    counts = {worker.port: 0 for worker in cluster.workers}
    for row in rows:
        counts[row["nodeport"]] += row["jobs"]
    return counts


async def test_the_sweeper_deletes_expired_jobs_from_every_shard(
    citus_cluster: CitusCluster, citus_dsn: str
) -> None:
    async with opened(PostgresStore(citus_dsn, connections=Connections(1, 2), listen=False)) as s:
        assert s.citus is not None
        owners = [f"owner-{n}" for n in range(40)]
        conn = await asyncpg.connect(citus_dsn)
        try:
            for owner in owners:
                for key, expiry in (("old", "-1 hour"), ("live", "1 hour")):
                    await conn.execute(
                        "INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path,"
                        " state, completed_by, response_status, expires_at) VALUES ($1, $2, $3,"
                        " 'fp', 'POST', '/', 'completed', 1, 200, now() + $4::text::interval)",
                        owner, key, uuid.uuid4(), expiry,
                    )  # fmt: skip
        finally:
            await conn.close()
        before = await _jobs_per_worker(citus_cluster, citus_dsn)
        assert all(count > 0 for count in before.values()), before  # both workers hold some
        swept = [await s.sweep_expired(15) for _ in range(4)]
        assert swept == [15, 15, 10, 0]
        after = await _jobs_per_worker(citus_cluster, citus_dsn)
        assert sum(after.values()) == len(owners)
        assert all(count > 0 for count in after.values()), after
        assert {job.key for job in await s.list_jobs(limit=100)} == {"live"}


# --- idemproxy migrate --distribute -----------------------------------------------------------


def migrate_cli(dsn: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "idemproxy", "migrate", "--store", dsn, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture
async def fresh_citus_database(citus_cluster: CitusCluster) -> AsyncIterator[str]:
    """A database of its own on the cluster, Citus in it, nothing migrated."""
    name = f"idemproxy_fresh_{secrets.token_hex(4)}"
    dsn = await citus_cluster.create_database(name)
    try:
        yield dsn
    finally:
        await citus_cluster.drop_database(name)


async def _distribution(dsn: str) -> list[tuple[str, str, str, int]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(load_queries("postgres")["distributed_tables"])
    finally:
        await conn.close()
    return sorted(tuple(row.values()) for row in rows)


async def test_migrate_distribute_creates_and_distributes_both_tables_once(
    fresh_citus_database: str,
) -> None:
    first = migrate_cli(fresh_citus_database, "--distribute")
    assert first.returncode == 0, first.stderr
    assert "distributed 2 table(s) by owner: idemproxy.jobs, idemproxy.attempts" in first.stdout
    [(attempts, *a_rest), (jobs, *j_rest)] = await _distribution(fresh_citus_database)
    assert (attempts, jobs) == ("idemproxy.attempts", "idemproxy.jobs")
    assert a_rest[:2] == j_rest[:2] == ["distributed", "owner"]
    assert a_rest[2] == j_rest[2], "co-located"

    again = migrate_cli(fresh_citus_database, "--distribute")
    assert again.returncode == 0, again.stderr
    assert "applied 0 migration(s)" in again.stdout
    assert "distributed 0 table(s) by owner (both already were)" in again.stdout
    assert await _distribution(fresh_citus_database) == sorted(
        [(attempts, *a_rest), (jobs, *j_rest)]
    )


async def test_migrations_after_distribution_reach_every_shard(fresh_citus_database: str) -> None:
    """A database distributed at the first migration takes the later ones (Citus propagates
    ALTER TABLE and CREATE INDEX to the shards), and the store then works on them."""
    [(first, schema), *later] = load_migrations("postgres")
    conn = await asyncpg.connect(fresh_citus_database)
    try:
        await conn.execute(
            "CREATE SCHEMA idemproxy; CREATE TABLE idemproxy.schema_migrations ("
            " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute(schema)
        await conn.execute("INSERT INTO idemproxy.schema_migrations (version) VALUES ($1)", first)
    finally:
        await conn.close()
    store = PostgresStore(fresh_citus_database, connections=Connections(1, 2), listen=False)
    await store.open()
    try:
        assert await store.distribute() == ["idemproxy.jobs", "idemproxy.attempts"]
        assert await store.migrate() == [version for version, _ in later]
        assert await store.migrate() == []
    finally:
        await store.close()
    result = migrate_cli(fresh_citus_database, "--distribute")
    assert result.returncode == 0 and "(both already were)" in result.stdout, result.stderr


@pytest.fixture
async def empty_postgres_database(pg_server_dsn: str) -> AsyncIterator[str]:
    """A database of its own on the plain PostgreSQL server, nothing in it."""
    name = f"idemproxy_plain_{os.getpid()}_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(pg_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield urlsplit(pg_server_dsn)._replace(path=f"/{name}").geturl()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@pytest.mark.postgres
async def test_migrate_distribute_on_plain_postgres_is_a_clear_error_and_changes_nothing(
    empty_postgres_database: str,
) -> None:
    result = migrate_cli(empty_postgres_database, "--distribute")
    assert result.returncode == 1
    assert "--distribute needs a Citus coordinator" in result.stderr
    assert "Traceback" not in result.stderr
    assert "applied" not in result.stdout
    conn = await asyncpg.connect(empty_postgres_database)
    try:
        schema = await conn.fetchval("SELECT to_regnamespace('idemproxy')")
    finally:
        await conn.close()
    assert schema is None, "the refusal came after the migrations were applied"


def test_migrate_distribute_on_sqlite_is_a_clear_error(sqlite_dsn: str) -> None:
    result = migrate_cli(sqlite_dsn, "--distribute")
    assert result.returncode == 1
    assert "--distribute needs a PostgreSQL store on a Citus coordinator" in result.stderr


async def test_concurrent_migrations_and_distributions_are_serialised(
    fresh_citus_database: str,
) -> None:
    """The migration runner's advisory lock is the coordinator's: three processes starting at
    once migrate and distribute once between them, and none fails."""
    stores = [
        PostgresStore(fresh_citus_database, connections=Connections(1, 1), listen=False)
        for _ in range(3)
    ]
    for store in stores:
        await store.open()
    try:

        async def start(store: PostgresStore) -> tuple[list[str], list[str]]:
            return await store.migrate(), await store.distribute()

        results = await asyncio.gather(*(start(store) for store in stores))
    finally:
        for store in stores:
            await store.close()
    applied = sorted(results, key=lambda result: -len(result[0]))
    assert applied[0][0] == [version for version, _ in load_migrations("postgres")]
    assert [result[0] for result in applied[1:]] == [[], []]
    assert sorted(len(result[1]) for result in results) == [0, 0, 2]


async def _local_copy_bytes(dsn: str) -> dict[str, int]:
    """What each table holds in the coordinator's own relation, beside its shards."""
    conn = await asyncpg.connect(dsn)
    try:
        sql = load_queries("postgres")["local_copy_bytes"]
        return {t: await conn.fetchval(sql, t) for t in ("idemproxy.jobs", "idemproxy.attempts")}
    finally:
        await conn.close()


async def test_distributing_tables_with_rows_leaves_no_copy_on_the_coordinator(
    fresh_citus_database: str,
) -> None:
    """Distributing copies the rows into the shards; the originals, never read again, are then
    removed from the coordinator's disk (a purged owner's response bodies must not stay there)."""
    assert migrate_cli(fresh_citus_database).returncode == 0  # migrated, not distributed
    body = secrets.token_bytes(64 * 1024)  # stored out of line (TOAST) too
    store = PostgresStore(fresh_citus_database, connections=Connections(1, 2), listen=False)
    async with opened(store) as s:
        intent = Intent("alice", "k", "fp", "POST", "/")
        claimed = await s.claim(intent, str(uuid.uuid4()), "primary", ttl=60.0, lease=30.0)
        assert isinstance(claimed, Claimed)
        assert await s.complete(claimed.job, 1, StoredResponse(201, (), body), ttl=60.0)
    before = await _local_copy_bytes(fresh_citus_database)
    assert all(size > 0 for size in before.values()), before

    result = migrate_cli(fresh_citus_database, "--distribute")
    assert result.returncode == 0, result.stderr
    assert await _local_copy_bytes(fresh_citus_database) == {
        "idemproxy.jobs": 0,
        "idemproxy.attempts": 0,
    }
    again = migrate_cli(fresh_citus_database, "--distribute")
    assert again.returncode == 0 and "(both already were)" in again.stdout, again.stderr
    store = PostgresStore(fresh_citus_database, connections=Connections(1, 2), listen=False)
    async with opened(store) as s:
        job = await s.get("alice", "k")  # read from its shard
        assert job is not None and isinstance(job.response, StoredResponse)
        assert job.response.body == body
        assert [a.number for a in (await s.get_by_id(job.id) or job).attempts] == [1]


async def test_quota_claims_run_on_the_owners_shard(fresh_citus_database: str) -> None:
    """SPEC §9 on Citus: the quota transaction's claim is the router form. Intermediate results
    (what a statement planned in steps through the coordinator ships around) are forbidden in
    this database, so a claim planned that way fails instead of passing slowly."""
    assert migrate_cli(fresh_citus_database, "--distribute").returncode == 0
    conn = await asyncpg.connect(fresh_citus_database)
    try:
        database = await conn.fetchval("SELECT current_database()")
        await conn.execute(
            f'ALTER DATABASE "{database}" SET citus.max_intermediate_result_size = 0'
        )
    finally:
        await conn.close()
    limits = QuotaLimits(in_flight=1, new_per_second=10, stored_bytes=1 << 20)
    store = PostgresStore(fresh_citus_database, connections=Connections(1, 2), listen=False)
    async with opened(store) as s:
        assert s.citus is not None

        async def claim(key: str) -> object:
            intent = Intent("alice", key, "fp", "POST", "/")
            return await s.claim_within(
                intent, str(uuid.uuid4()), "primary", ttl=60.0, lease=30.0, limits=limits
            )

        first = await claim("a")
        assert isinstance(first, Claimed) and first.attempt == 1
        assert await claim("b") == "in_flight"
        assert await s.get("alice", "b") is None
        again = await claim("a")
        assert isinstance(again, Existing) and again.job.id == first.job.id
        stored = await s.get_by_id(first.job.id)
        assert stored is not None and [a.number for a in stored.attempts] == [1]
