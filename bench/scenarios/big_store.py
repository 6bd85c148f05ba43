"""--big-store: new keys and replays at saturation (replays read from the store: the in-process
cache off) on an empty store, then on one of --big-store-rows jobs in a throwaway database (the
variants big-store-empty and big-store of new-pg and replay-pg)."""

from __future__ import annotations

import time
from typing import Any

from common import BENCH_DB, BIG_DB, drop_db, pg, recreate_db, running
from model import CONCURRENCY, Scenario
from runner import NO_REPLAY_CACHE, Bench, Step
from scenarios.proxy_pg import NEW_PG, REPLAY_PG


def run(bench: Bench) -> None:
    """New keys and replays at saturation on an empty store, then on one of
    --big-store-rows jobs (one INSERT … SELECT generate_series, jobs and attempts)."""
    recreate_db(bench.args.pg_dsn, BIG_DB)
    bench.database = BIG_DB
    try:
        io: dict[str, Any] = {}
        proxy = bench.start_proxy("proxy-pg", bench.pg_store(), env=NO_REPLAY_CACHE)
        with running(proxy):
            bench.variant = "big-store-empty"
            io["new-pg@empty"] = _measure_io(bench, NEW_PG)
            bench.prewarm_replays(proxy, "big-empty")
            io["replay-pg@empty"] = _measure_io(bench, REPLAY_PG)
            bench.variant = ""
            rows = bench.args.big_store_rows
            print(f"bench: big store: generating {rows:,} jobs …", flush=True)
            started = time.monotonic()
            pg(
                bench.args.pg_dsn,
                _BIG_STORE,
                rows,
                database=BIG_DB,
                session=["SET session_replication_role = replica"],
            )
            generated = time.monotonic() - started
            pg(bench.args.pg_dsn, "VACUUM (ANALYZE) idemproxy.jobs", database=BIG_DB)
            pg(bench.args.pg_dsn, "VACUUM (ANALYZE) idemproxy.attempts", database=BIG_DB)
            pg(bench.args.pg_dsn, "CHECKPOINT", database=BIG_DB)
            prepared = time.monotonic() - started
            size = pg(
                bench.args.pg_dsn,
                "SELECT pg_size_pretty(pg_database_size(current_database()))",
                database=BIG_DB,
            )[0][0]
            bench.variant = "big-store"
            io["new-pg@big"] = _measure_io(bench, NEW_PG)
            bench.replay_prefix, bench.replay_count = "big", rows  # keys spread over them all
            io["replay-pg@big"] = _measure_io(bench, REPLAY_PG)
            bench.extras["big_store"] = {
                "rows": rows,
                "generate_seconds": generated,
                "prepare_seconds": prepared,
                "size": size,
                "io": io,
            }
    finally:
        bench.variant = ""
        bench.database = BENCH_DB
        drop_db(bench.args.pg_dsn, BIG_DB)


def _measure_io(bench: Bench, scenario: Scenario) -> dict[str, dict[str, float]]:
    """One run at saturation, with the database's buffer reads per request by relation:
    *read* blocks came from outside shared_buffers (the OS cache or the disk), *hit* from
    inside (pg_statio_user_tables and _indexes of the current database), and the
    sequential and index scans per request (pg_stat_user_tables and _indexes)."""
    snapshots: dict[str, dict[str, tuple[int, ...]]] = {}

    def probe(when: str) -> None:
        # An idle backend reports its statistics within 10 s (PostgreSQL 15's
        # PGSTAT_IDLE_INTERVAL): wait for the pool's connections to report, then read.
        time.sleep(11.0)
        snapshots[when] = _statio(bench)

    bench.io_probe = probe
    try:
        bench.measure(scenario, CONCURRENCY[-1:])
    finally:
        bench.io_probe = None
    before, after = snapshots["start"], snapshots["stop"]
    requests = max(bench.results[-1].requests, 1)
    fields = ("read", "hit", "seq_scans", "idx_scans")
    zero = (0, 0, 0, 0)
    return {
        name: {
            field_name: (after[name][i] - before.get(name, zero)[i]) / requests
            for i, field_name in enumerate(fields)
        }
        for name in after
    }


def _statio(bench: Bench) -> dict[str, tuple[int, ...]]:
    rows = pg(bench.args.pg_dsn, _STATIO, database=bench.database)
    return {str(row[0]): tuple(int(value or 0) for value in row[1:]) for row in rows}


# Copies of one real completed job (the pre-warmed replay key `…-big-empty-0`: its owner,
# fingerprint and stored response), under keys big-0 … big-(N-1), with one attempt each.
# session_replication_role = replica skips the foreign-key trigger: the rows satisfy it by
# construction, and checking ten million of them would double the load time.
_BIG_STORE = """
WITH template AS (
    SELECT * FROM idemproxy.jobs WHERE key LIKE '%-big-empty-0' AND state = 'completed' LIMIT 1
), jobs AS (
    INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, state, version,
                                attempt_count, completed_by, response_status, response_headers,
                                response_body, created_at, updated_at, expires_at)
    SELECT t.owner, 'big-' || g, gen_random_uuid(), t.fingerprint, t.method, t.path, 'completed',
           2, 1, 1, t.response_status, t.response_headers, t.response_body, now(), now(),
           now() + interval '1 day'
    FROM template t, generate_series(0, $1::bigint - 1) AS g
    RETURNING owner, id
)
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, state, status, finished_at)
SELECT owner, id, 1, 'http://127.0.0.1/', 'succeeded', 201, now() FROM jobs
"""

_STATIO = """
SELECT s.relname || ' (table)', s.heap_blks_read, s.heap_blks_hit, t.seq_scan, t.idx_scan
FROM pg_statio_user_tables s JOIN pg_stat_user_tables t USING (relid)
WHERE s.schemaname = 'idemproxy'
UNION ALL
SELECT s.indexrelname, s.idx_blks_read, s.idx_blks_hit, 0, i.idx_scan
FROM pg_statio_user_indexes s JOIN pg_stat_user_indexes i USING (indexrelid)
WHERE s.schemaname = 'idemproxy'
"""


STEP = Step("big-store", (), run, option="big_store")
