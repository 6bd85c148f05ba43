"""The store contract of the process's lifecycle (SPEC §11): readiness's ping, migrations, and a
store that is gone being `StoreUnavailable`, on every store of tests/store/conftest.py."""

from __future__ import annotations

import uuid
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest

from idemproxy.errors import StoreUnavailable
from idemproxy.store.factory import create_store
from idemproxy.store.ports import JobStore, Lifecycle
from idemproxy.store.queries import load_migrations

from .test_contract import (
    LEASE,
    TTL,
    allow_connections,
    claim,
    end_connections,
    intent,
    open_store,
    wait_until_listening,
)


async def test_ping(lifecycle: Lifecycle) -> None:
    await lifecycle.ping()


async def test_migrate_again_applies_nothing(hot: JobStore, lifecycle: Lifecycle) -> None:
    assert await lifecycle.migrate() == []
    await claim(hot)


async def test_migrate_a_new_sqlite_database(sqlite_dsn: str) -> None:
    async with open_store(sqlite_dsn) as store:
        assert await store.migrate() == [version for version, _ in load_migrations("sqlite")]
        assert await store.migrate() == []


@pytest.mark.postgres
async def test_unreachable_postgres_is_store_unavailable() -> None:
    store = create_store("postgresql://postgres@127.0.0.1:1/postgres", command_timeout=1.0)
    try:
        with pytest.raises(StoreUnavailable):  # from open(), or from the first call at the latest
            await store.open()
            await store.ping()
    finally:
        await store.close()


@pytest.mark.postgres
async def test_postgres_going_away_is_store_unavailable(pg_dsn: str, pg_server_dsn: str) -> None:
    database = urlsplit(pg_dsn).path.lstrip("/")
    async with open_store(pg_dsn) as store:
        await store.ping()
        admin = await asyncpg.connect(pg_server_dsn)
        try:
            await allow_connections(admin, database, allow=False)
            await end_connections(admin, database)
            with pytest.raises(StoreUnavailable):
                await store.ping()
            with pytest.raises(StoreUnavailable):
                await store.claim(intent(), str(uuid.uuid4()), "primary", ttl=TTL, lease=LEASE)
            await allow_connections(admin, database, allow=True)
        finally:
            await admin.close()
        await store.ping()  # the pool reconnects on its own
        await wait_until_listening(store)  # and so does the change feed


async def test_a_corrupt_sqlite_file_is_store_unavailable(tmp_path: Path) -> None:
    (tmp_path / "idemproxy.db").write_bytes(b"this is not a database" * 100)
    store = create_store(f"sqlite:///{tmp_path}/idemproxy.db")
    try:
        with pytest.raises(StoreUnavailable):
            await store.open()
            await store.migrate()
    finally:
        await store.close()


async def test_a_closed_store_is_store_unavailable(hot: JobStore, lifecycle: Lifecycle) -> None:
    await lifecycle.close()
    with pytest.raises(StoreUnavailable):
        await lifecycle.ping()
    with pytest.raises(StoreUnavailable):
        await hot.get("alice", "k1")
