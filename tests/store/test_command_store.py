"""A command that only reads and writes jobs (`jobs …`, `migrate`) opens the store without the
change feed: only a serving proxy follows it, and a feed cut off mid-connect as the command
exited left asyncpg's "Future exception was never retrieved" on the operator's terminal."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import asyncpg
import pytest

from idemproxy.store.factory import command_store, create_store

pytestmark = pytest.mark.postgres


async def _listening(pg_dsn: str) -> int:
    database = urlsplit(pg_dsn).path.lstrip("/")
    admin = await asyncpg.connect(pg_dsn)
    try:
        count: int = await admin.fetchval(
            # The feed's last statement: its LISTEN, or the clock reading that follows it.
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1"
            " AND (query LIKE 'LISTEN %' OR query LIKE '%clock_timestamp()%')"
            " AND pid <> pg_backend_pid()",
            database,
        )
        return count
    finally:
        await admin.close()


async def _until_listening(pg_dsn: str) -> None:
    deadline = time.monotonic() + 5
    while not await _listening(pg_dsn):
        assert time.monotonic() < deadline, "the serving store never listened"
        await asyncio.sleep(0.05)


async def test_a_command_s_store_does_not_follow_the_change_feed(pg_dsn: str) -> None:
    serving = create_store(pg_dsn)
    await serving.open()
    try:
        await _until_listening(pg_dsn)  # what the check below would see
    finally:
        await serving.close()
    command = command_store(pg_dsn, max_connections=2)
    await command.open()
    try:
        assert await command.get("owner", "no-such-key") is None
        await asyncio.sleep(0.3)
        assert await _listening(pg_dsn) == 0
    finally:
        await command.close()
