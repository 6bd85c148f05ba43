"""The database's own limit for the proxy's claim + completion, no HTTP (pgbench_claim.py)."""

from __future__ import annotations

import subprocess
import sys

import pgbench_claim
from common import PATH, PGBENCH_DB, PgTicks, drop_db, pg_dsn, recreate_db
from model import CONCURRENCY, Scenario
from runner import Bench, Step

PGBENCH = Scenario("pgbench", "pgbench claim + complete (no HTTP)", "pgbench", "")


def run(bench: Bench) -> None:
    recreate_db(bench.args.pg_dsn, PGBENCH_DB)
    try:
        dsn = pg_dsn(bench.args.pg_dsn, PGBENCH_DB)
        subprocess.run(
            [sys.executable, "-m", "idemproxy", "migrate", "--store", dsn],
            check=True,
            capture_output=True,
            timeout=60,
        )
        script = pgbench_claim.write_script(bench.run_dir / "pgbench-claim-complete.sql")
        values = pgbench_claim.variables(PATH)
        for threads, clients in CONCURRENCY:
            label = f"pgbench-c{clients}"
            print(f"bench: {label}: {bench.args.duration:g}s …", flush=True)
            if bench.args.warmup > 0:
                pgbench_claim.run(
                    bench.tools["pgbench"],
                    dsn,
                    script,
                    values,
                    clients,
                    threads,
                    bench.args.warmup,
                    bench.run_dir,
                    f"warm-{label}",
                )
            before = bench.ticks([], None, None)
            with PgTicks(PGBENCH_DB) as pg_ticks:
                raw = pgbench_claim.run(
                    bench.tools["pgbench"],
                    dsn,
                    script,
                    values,
                    clients,
                    threads,
                    bench.args.duration,
                    bench.run_dir,
                    label,
                )
            after = bench.ticks([], None, None)
            bench.record(PGBENCH, threads, clients, raw, 0, before, after, pg_ticks, None)
    finally:
        drop_db(bench.args.pg_dsn, PGBENCH_DB)


STEP = Step("pgbench", (PGBENCH,), run)
