"""What one new key writes in PostgreSQL: WAL bytes, WAL records (index entries), HOT updates.

Runs on a throwaway PostgreSQL server of its own (tests/support/pgserver.py), so that nobody
else's WAL is counted: the store's claim and completion, one new key at a time (as at c=1),
200 unmeasured, then 1,000 measured, read with pg_walinspect. `--upto N` applies only the first
N migrations (the schema before a change; the `started_by` column is added either way, since the
store reads it). `--concurrency N`: N keys at a time (as at c=N: the store batches their claims
and completions, and a page holds the versions of several jobs in flight at once).
docs/benchmarks.md, "Write cost per new key".

    .venv/bin/python bench/write_cost.py [--upto 4] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from idemproxy.core.types import Claimed, Intent, StoredResponse  # noqa: E402
from idemproxy.store.postgres.store import Connections, PostgresStore  # noqa: E402
from idemproxy.store.queries import load_migrations, statements  # noqa: E402
from tests.support.pgserver import ThrowawayPostgres  # noqa: E402

WARM, MEASURED = 200, 1000
RESPONSE = StoredResponse(
    201, (("content-type", "application/json"), ("location", "/things/1")), b'{"id":1}'
)
WAL = """
SELECT "resource_manager/record_type" AS kind, count FROM pg_get_wal_stats($1, $2, true)
WHERE count > 0 ORDER BY 1
"""
UPDATES = """
SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
WHERE schemaname = 'idemproxy' AND relname IN ('jobs', 'attempts') ORDER BY 1
"""


async def _schema(conn: asyncpg.Connection, upto: int) -> None:
    await conn.execute(
        "CREATE EXTENSION pg_walinspect; CREATE SCHEMA idemproxy;"
        " CREATE TABLE idemproxy.schema_migrations (version text PRIMARY KEY,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for version, sql in load_migrations("postgres")[:upto]:
        for statement in statements(sql):
            await conn.execute(statement)
        await conn.execute("INSERT INTO idemproxy.schema_migrations VALUES ($1)", version)
    await conn.execute("ALTER TABLE idemproxy.jobs ADD COLUMN IF NOT EXISTS started_by uuid")


async def _new_key(store: PostgresStore, key: str) -> None:
    intent = Intent("anonymous", key, "fp", "POST", "/orders")
    claimed = await store.claim(intent, str(uuid.uuid4()), "http://up", ttl=86400.0, lease=30.0)
    assert isinstance(claimed, Claimed)
    assert await store.complete(claimed.job, 1, RESPONSE, ttl=86400.0)


async def _new_keys(store: PostgresStore, prefix: str, count: int, concurrency: int) -> None:
    """`count` new keys, `concurrency` at a time."""

    async def one_at_a_time(worker: int) -> None:
        for number in range(worker, count, concurrency):
            await _new_key(store, f"{prefix}-{number}")

    await asyncio.gather(*(one_at_a_time(worker) for worker in range(concurrency)))


async def measure(dsn: str, upto: int, concurrency: int) -> None:
    conn = await asyncpg.connect(dsn)
    await _schema(conn, upto)
    pool = max(2, min(concurrency, 20))
    store = PostgresStore(dsn, connections=Connections(2, pool), listen=False)
    await store.open()
    try:
        await _new_keys(store, "warm", WARM, concurrency)
        start = await conn.fetchval("SELECT pg_current_wal_lsn()")
        await _new_keys(store, "key", MEASURED, concurrency)
        end = await conn.fetchval("SELECT pg_current_wal_lsn()")
    finally:
        await store.close()
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await asyncio.sleep(1.0)  # the statistics of the store's sessions, flushed at their end
    wal = await conn.fetchval("SELECT pg_wal_lsn_diff($1, $2)", end, start)
    records = {row["kind"]: row["count"] / MEASURED for row in await conn.fetch(WAL, start, end)}
    btree = sum(n for kind, n in records.items() if kind.startswith("Btree/INSERT_LEAF"))
    print(f"WAL bytes per new key: {float(wal) / MEASURED:,.0f}")
    print(f"index entries (B-tree leaf inserts) per new key: {btree:.2f}")
    print("WAL records per new key:", {kind: round(n, 2) for kind, n in records.items()})
    for row in await conn.fetch(UPDATES):  # every key's, the unmeasured ones too
        print(f"{row['relname']}: {row['n_tup_upd']} updates, {row['n_tup_hot_upd']} HOT")
    heap = await conn.fetchval("SELECT pg_relation_size('idemproxy.jobs')")
    print(f"jobs heap bytes per key (before any vacuum): {heap / (WARM + MEASURED):,.0f}")
    await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upto", type=int, default=None, help="apply the first N migrations")
    parser.add_argument("--concurrency", type=int, default=1, help="new keys at a time")
    args = parser.parse_args()
    server = ThrowawayPostgres()
    server.start()
    try:
        asyncio.run(server.execute('CREATE DATABASE "write_cost"'))
        asyncio.run(measure(server.dsn("write_cost"), args.upto or 10_000, args.concurrency))
    finally:
        server.destroy()


if __name__ == "__main__":
    main()
