"""The minimal proxy (minimal_proxy.py): claim, forward, complete on aiohttp and asyncpg, one
table, nothing else; the yardstick for idemproxy's new keys on PostgreSQL."""

from __future__ import annotations

import sys

from common import BENCH, Service, free_port, running
from model import Scenario
from runner import Bench, Step

# "proxy-pg…": PostgreSQL's CPU is measured as for idemproxy (the same database).
NEW_MINIMAL = Scenario(
    "new-minimal",
    "minimal proxy new keys (aiohttp + asyncpg, one table)",
    "proxy-pg-minimal",
    "unique_key.lua",
)


def run(bench: Bench) -> None:
    port = free_port()
    argv = [sys.executable, str(BENCH / "minimal_proxy.py"), "--listen", f"127.0.0.1:{port}"]
    argv += ["--upstream", bench.services["backend"].url, "--dsn", bench.pg_store()]
    service = Service("proxy-pg-minimal", argv, port, bench.run_dir)
    bench.services["proxy-pg-minimal"] = service
    with running(service):
        bench.measure(NEW_MINIMAL)


STEP = Step("minimal", (NEW_MINIMAL,), run)
