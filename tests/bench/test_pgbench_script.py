"""The benchmark's pgbench script is generated from the proxy's own claim and completion
statements (bench/pgbench_claim.py): when either statement gains a parameter, the script must
still bind every one and run, or `bench/run` fails at its pgbench step."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path

import asyncpg
import pytest

from idemproxy.store.postgres.store import PostgresStore

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # its modules import each other by name, as bench/run runs them
pgbench_claim = importlib.import_module("pgbench_claim")

pytestmark = pytest.mark.postgres


def test_every_parameter_is_bound(tmp_path: Path) -> None:
    script = pgbench_claim.write_script(tmp_path / "claim-complete.sql").read_text()

    assert "$" not in script.replace("$$", "")
    assert "INSERT INTO idemproxy.jobs" in script
    assert "UPDATE idemproxy.jobs" in script


async def test_the_script_claims_and_completes_one_job(pg_dsn: str, tmp_path: Path) -> None:
    store = PostgresStore(pg_dsn)
    await store.open()
    try:
        await store.migrate()
    finally:
        await store.close()
    script = pgbench_claim.write_script(tmp_path / "claim-complete.sql")
    argv = ["pgbench", "-n", "-M", "prepared", "-t", "3", "-f", str(script)]
    for name, value in pgbench_claim.variables("/orders").items():
        argv += ["-D", f"{name}={value}"]
    pgbench = await asyncio.create_subprocess_exec(
        *argv, pg_dsn, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(pgbench.communicate(), 60)

    assert pgbench.returncode == 0, stderr.decode()
    assert "number of failed transactions: 0" in stdout.decode()
    completed = await _completed_jobs(pg_dsn)
    assert completed == 3


async def _completed_jobs(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        value = await conn.fetchval(
            "SELECT count(*) FROM idemproxy.jobs WHERE state = 'completed'"
            " AND response_body IS NOT NULL"
        )
    finally:
        await conn.close()
    return int(value)
