"""--sweeper: new keys at saturation while SWEEP_RATE jobs expire per second, against the same
load with nothing to sweep (the variants sweeper-idle and sweeper-busy of new-pg)."""

from __future__ import annotations

import threading
import time

from common import pg, pg_jobs, running
from model import CONCURRENCY
from runner import Bench, Step
from scenarios.proxy_pg import NEW_PG

SWEEP_RATE = 1000  # jobs expiring per second


def run(bench: Bench) -> None:
    """New keys at saturation with the sweeper idle, then with SWEEP_RATE jobs expiring per
    second (generated with one INSERT … SELECT generate_series), sweeping every second."""
    env = {"IDEMPROXY_SWEEPER__INTERVAL": "1"}
    with running(bench.start_proxy("proxy-sweeper", bench.pg_store(), env=env)):
        bench.services["proxy-pg"] = bench.services["proxy-sweeper"]
        bench.variant = "sweeper-idle"
        bench.measure(NEW_PG, CONCURRENCY[-1:])
        window = bench.args.warmup + bench.args.duration + 3
        rows = int(SWEEP_RATE * window)
        start = time.monotonic()
        pg(
            bench.args.pg_dsn,
            _EXPIRING_JOBS,
            rows,
            SWEEP_RATE,
            f"{bench.nonce}-expiring",
            database=bench.database,
        )
        backlog: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.5):
                backlog.append(_expired_backlog(bench))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        bench.variant = "sweeper-busy"
        try:
            bench.measure(NEW_PG, CONCURRENCY[-1:])
        finally:
            stop.set()
            watcher.join()
            bench.variant = ""
        elapsed = time.monotonic() - start
        time.sleep(2.0)
        bench.extras["sweeper"] = {
            "rate": SWEEP_RATE,
            "rows": rows,
            "interval": 1.0,
            "elapsed": elapsed,
            "backlog_max": max(backlog, default=0),
            "backlog_samples": backlog,
            "backlog_end": _expired_backlog(bench),
            "left": pg_jobs(bench.args.pg_dsn, f"{bench.nonce}-expiring", bench.database),
        }


def _expired_backlog(bench: Bench) -> int:
    rows = pg(
        bench.args.pg_dsn,
        "SELECT count(*) FROM idemproxy.jobs WHERE expires_at <= now() "
        "AND state IN ('completed', 'released')",
        database=bench.database,
    )
    return int(rows[0][0])


# $1 jobs expiring $2 per second from one second from now, completed, with one attempt each.
_EXPIRING_JOBS = """
WITH jobs AS (
    INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, state, version,
                                completed_by, response_status, response_headers, response_body,
                                expires_at)
    SELECT 'anonymous', $3::text || '-' || g, gen_random_uuid(), repeat('0', 64), 'POST', '/orders',
           'completed', 2, 1, 201, '[["Content-Type","application/json"]]'::jsonb,
           '\\x7b7d'::bytea, now() + interval '1 second' + g * interval '1 second' / $2::int
    FROM generate_series(0, $1::int - 1) AS g
    RETURNING owner, id
)
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, state, status, finished_at)
SELECT owner, id, 1, 'http://127.0.0.1/', 'succeeded', 201, now() FROM jobs
"""


STEP = Step("sweeper", (), run, option="sweeper")
