"""SPEC §9 on SQLite: a new key under quotas counts its owner's jobs in flight and those of the
rate window, not every job of the owner, whether or not the database was analyzed.

Work is measured in SQLite virtual machine instructions (sqlite3's progress handler), which
grow with the rows a statement reads: 100,000 old jobs of one owner read through its
`(owner, id)` key cost millions; the lookups of its few live jobs, hundreds.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from idemproxy.core.quota import window_start_id
from idemproxy.identity.intent import new_job_id
from idemproxy.store.queries import load_queries
from idemproxy.store.sqlite.statements import migrate

_JOBS = 100_000
_LIVE = 2
# A few index lookups and the rows they return take hundreds of instructions; a scan of one
# owner's 100,000 jobs takes millions.
_MOST_INSTRUCTIONS = 5_000
_STEP = 100  # the progress handler runs every this many instructions


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A migrated store holding 100,000 completed jobs of `acme` from a day ago (their ids
    time-ordered, as the proxy makes them, and older than the rate window's) and two of its
    jobs in flight."""
    db = sqlite3.connect(tmp_path / "idemproxy.db")
    try:
        migrate(db)
        day_ago = time.time() - 86400
        old = [(f"old-{n}", str(uuid.UUID(int=n)), day_ago) for n in range(_JOBS)]
        db.executemany(
            "INSERT INTO jobs (owner, key, id, fingerprint, method, path, state, completed_by,"
            " response_status, created_at, updated_at, expires_at)"
            " VALUES ('acme', ?, ?, 'f', 'POST', '/pay', 'completed', 1, 201, ?, ?3, ?3 + 172800)",
            old,
        )
        live = [(f"live-{n}", new_job_id(), time.time()) for n in range(_LIVE)]
        db.executemany(
            "INSERT INTO jobs (owner, key, id, fingerprint, method, path, created_at, updated_at,"
            " expires_at, lease_expires_at)"
            " VALUES ('acme', ?, ?, 'f', 'POST', '/pay', ?3 - 60, ?3, ?3 + 86400, ?3 + 60)",
            live,
        )
        db.commit()
        yield db
    finally:
        db.close()


def _instructions(db: sqlite3.Connection, sql: str, params: dict[str, object]) -> int:
    """The virtual machine instructions (to within _STEP) the statement takes; and it counts
    the live jobs."""
    steps = 0

    def step() -> int:
        nonlocal steps
        steps += 1
        return 0  # go on

    db.set_progress_handler(step, _STEP)
    try:
        usage = db.execute(sql, params).fetchone()
    finally:
        db.set_progress_handler(None, _STEP)
    assert usage[:3] == (0, _LIVE, 0)  # taken, in flight, recent
    return steps * _STEP


def test_the_quota_count_reads_only_the_owners_live_jobs(db: sqlite3.Connection) -> None:
    sql = load_queries("sqlite")["quota_usage"]
    params = {"owner": "acme", "key": "new-0", "since": window_start_id(), "bytes": False}
    assert _instructions(db, sql, params) < _MOST_INSTRUCTIONS
    db.execute("ANALYZE")
    assert _instructions(db, sql, params) < _MOST_INSTRUCTIONS
