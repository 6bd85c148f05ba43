"""A SQLite file the proxy can read but not write: every claim would fail, so readiness says
`read-only` (docs/deploy.md, Probes) rather than `ok`. SQLite opens a file the process may not
write read-only without a word; a write that changes nothing is how the ping finds out."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from idemproxy.store.factory import create_store
from idemproxy.store.queries import load_queries
from idemproxy.store.sqlite.statements import on_read_only_mount, opened_read_only
from idemproxy.store.sqlite.store import SqliteStore

READ_ONLY = load_queries("sqlite")["read_only"]


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
        assert opened_read_only(read_only, READ_ONLY) is True
        writable = sqlite3.connect(path, isolation_level=None)
        try:
            assert opened_read_only(writable, READ_ONLY) is False
            # The write that changes nothing left nothing behind.
            assert writable.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
        finally:
            writable.close()
    finally:
        read_only.close()


async def test_a_file_not_migrated_yet_is_not_said_to_be_read_only(tmp_path: Path) -> None:
    fresh = sqlite3.connect(tmp_path / "fresh.db", isolation_level=None)
    try:
        assert opened_read_only(fresh, READ_ONLY) is False
    finally:
        fresh.close()


def test_a_writable_mount_is_not_read_only(tmp_path: Path) -> None:
    """A file system mounted read-only is found by its mount flags (statvfs), not by the file's
    permissions, which an open connection does not ask again."""
    assert on_read_only_mount(str(tmp_path / "jobs.db")) is False
    assert on_read_only_mount(":memory:") is False


async def test_the_ping_does_not_wait_for_another_writer(
    store: SqliteStore, tmp_path: Path
) -> None:
    """Readiness asks no lock: another process holding the write lock (an operator's command)
    does not hold the store's one thread for busy_timeout."""
    other = sqlite3.connect(tmp_path / "jobs.db", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        assert await asyncio.wait_for(store.ping(), timeout=1.0) is True
    finally:
        other.execute("ROLLBACK")
        other.close()
