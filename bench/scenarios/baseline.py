"""--baseline REV: new keys on PostgreSQL and on SQLite with another revision of the proxy (the
variant `baseline` of new-pg and new-sqlite), in the same run and against the same backend,
database server and disk, so that a change of design is judged against what it replaces.

The revision is checked out with `git worktree` into the run's directory and installed, with its
own dependencies, into a virtualenv of its own under build/ (kept for later runs); it gets a
database of its own (its migrations may differ) and an SQLite file of its own.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from common import BASE_DB, drop_db, recreate_db, revision_python, running, worktree
from model import Scenario
from runner import Bench, Step
from scenarios.proxy_pg import NEW_PG
from scenarios.sqlite import NEW_SQLITE

VARIANT = "baseline"


def run(bench: Bench) -> None:
    revision = bench.args.baseline
    with worktree(revision, bench.run_dir / "baseline") as source:
        python = revision_python(source)
        bench.extras["baseline"] = {"revision": revision, "commit": _commit(source)}
        if bench.wanted(NEW_PG.name):
            _new_pg(bench, python)
        if bench.wanted(NEW_SQLITE.name):
            _new_sqlite(bench, python)


def _new_pg(bench: Bench, python: Path) -> None:
    recreate_db(bench.args.pg_dsn, BASE_DB)
    bench.database = BASE_DB
    try:
        with running(bench.start_proxy(NEW_PG.target, bench.pg_store(), python=python)):
            _measure_variant(bench, NEW_PG)
    finally:
        bench.database = bench.main_database
        drop_db(bench.args.pg_dsn, BASE_DB)


def _new_sqlite(bench: Bench, python: Path) -> None:
    bench.sqlite_file = "sqlite-baseline.db"
    try:
        store = f"sqlite:///{bench.sqlite_path}"
        with running(bench.start_proxy(NEW_SQLITE.target, store, python=python)):
            _measure_variant(bench, NEW_SQLITE)
    finally:
        bench.sqlite_file = bench.main_sqlite_file


def _measure_variant(bench: Bench, scenario: Scenario) -> None:
    bench.variant = VARIANT
    try:
        bench.measure(scenario)
    finally:
        bench.variant = ""


def _commit(source: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


STEP = Step("baseline", (), run, option="baseline")
