"""A SQLite file the proxy can read but not write: every claim would fail, so readiness says
`read-only` (docs/deploy.md, Probes) rather than `ok`. SQLite opens a file the process may not
write read-only without a word; a write that changes nothing is how the ping finds out."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from idemproxy.store.factory import create_store
from idemproxy.store.queries import load_queries
from idemproxy.store.sqlite.statements import ping
from idemproxy.store.sqlite.store import SqliteStore

PING = load_queries("sqlite")["ping"]


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


async def test_a_writable_file_is_said_to_take_writes(store: SqliteStore) -> None:
    assert await store.ping() is True


async def test_a_file_opened_read_only_is_said_to_take_none(
    store: SqliteStore, tmp_path: Path
) -> None:
    """What SQLite does with a file the process may not write (a volume owned by another user,
    a read-only mount at start): it opens it for reading only."""
    path = tmp_path / "jobs.db"
    read_only = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    try:
        assert ping(read_only, PING, str(path)) is False
        writable = sqlite3.connect(path, isolation_level=None)
        try:
            assert ping(writable, PING, str(path)) is True
            # The write that changes nothing left nothing behind, in a row or in a version.
            assert writable.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
        finally:
            writable.close()
    finally:
        read_only.close()
