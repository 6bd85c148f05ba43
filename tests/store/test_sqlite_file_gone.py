"""The SQLite file deleted or replaced while the proxy runs: the open connection would go on
writing to a file no restart finds, and every key would run again after one. The store fails
closed instead (SPEC §11: `503 store-unavailable`, nothing forwarded), and readiness says so."""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from idemproxy.core.types import Claimed, Intent
from idemproxy.errors import StoreUnavailable
from idemproxy.store.factory import create_store
from idemproxy.store.sqlite.store import SqliteStore

INTENT = Intent("alice", "k1", "fp", "POST", "/charges")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = create_store(f"sqlite:///{tmp_path}/jobs.db")
    assert isinstance(opened, SqliteStore)
    await opened.open()
    await opened.migrate()
    try:
        yield opened
    finally:
        await opened.close()


async def _claim(store: SqliteStore, key: str) -> object:
    intent = Intent(INTENT.owner, key, INTENT.fingerprint, INTENT.method, INTENT.path)
    return await store.claim(intent, str(uuid.uuid4()), "primary", ttl=60.0, lease=30.0)


async def test_a_deleted_file_fails_closed(
    store: SqliteStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert isinstance(await _claim(store, "before"), Claimed)
    os.unlink(tmp_path / "jobs.db")
    with pytest.raises(StoreUnavailable):
        await _claim(store, "after")
    with pytest.raises(StoreUnavailable):
        await store.ping()  # /readyz: not ready
    assert [r for r in caplog.records if "removed or replaced" in r.getMessage()]


async def test_a_replaced_file_fails_closed(store: SqliteStore, tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    other.write_bytes(b"")
    os.replace(other, tmp_path / "jobs.db")
    with pytest.raises(StoreUnavailable):
        await _claim(store, "after")


@pytest.mark.parametrize("suffix", ["-wal", "-shm"])
async def test_a_deleted_write_ahead_log_fails_closed(
    store: SqliteStore, tmp_path: Path, suffix: str
) -> None:
    """The commits not yet checkpointed live in the -wal file: deleted under the running proxy,
    a crash loses them (their keys would run again), so the store fails closed as it does for
    the database file. Deleting the -shm file lets a second process make another index of the
    same log."""
    assert isinstance(await _claim(store, "before"), Claimed)
    assert isinstance(await _claim(store, "seen"), Claimed)  # the log and index are known now
    os.unlink(tmp_path / f"jobs.db{suffix}")
    with pytest.raises(StoreUnavailable):
        await _claim(store, "after")
    with pytest.raises(StoreUnavailable):
        await store.ping()


async def test_a_checkpoint_keeps_the_store_open(store: SqliteStore, tmp_path: Path) -> None:
    """SQLite truncates and reuses its log while a connection is open, and never deletes it:
    a checkpoint, here forced on a second connection as another process's would be, is no
    removal."""
    for number in range(3):
        assert isinstance(await _claim(store, f"k{number}"), Claimed)
    other = sqlite3.connect(tmp_path / "jobs.db")
    try:
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        other.close()
    assert isinstance(await _claim(store, "after"), Claimed)
    await store.ping()


async def test_a_full_disk_fails_closed_and_the_log_says_why(
    store: SqliteStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A write the database cannot take (`database or disk is full`: here its page limit, as
    a full disk would) is `503 store-unavailable`, and the one line an operator has to go on
    names SQLite's error."""
    assert isinstance(await _claim(store, "before"), Claimed)
    await store.worker.run(_no_more_pages)
    with pytest.raises(StoreUnavailable):
        for number in range(200):  # a page's worth of jobs, then one more
            await _claim(store, f"k{number}-" + "x" * 200)
    said = [r.getMessage() for r in caplog.records if r.name == "idemproxy.store"]
    assert any("database or disk is full" in line for line in said), said


def _no_more_pages(db: sqlite3.Connection) -> None:
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")
