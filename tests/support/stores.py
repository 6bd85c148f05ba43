"""Stores opened for a test: migrated on the way in, closed on the way out."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import TypedDict, TypeVar

import asyncpg

from idemproxy.store.base import Store
from idemproxy.store.postgres.store import Connections, PostgresStore

S = TypeVar("S", bound=Store)


class CacheBounds(TypedDict):
    """The bounds of an in-process replay cache (`MemoryReplayCache(store, **bounds)`)."""

    max_bytes: int
    max_body: int
    ttl: float


@contextlib.asynccontextmanager
async def opened(store: S) -> AsyncIterator[S]:
    """`store`, open and migrated, for the duration of the block; closed whatever happens."""
    await store.open()
    try:
        await store.migrate()
        yield store
    finally:
        await store.close()


async def migrate_postgres(dsn: str) -> None:
    """Apply every migration to the PostgreSQL database at `dsn` (for a template database)."""
    async with opened(PostgresStore(dsn, connections=Connections(1, 1), listen=False)):
        pass


async def distribute_postgres(dsn: str) -> None:
    """Migrate the Citus coordinator's database at `dsn` and distribute both tables by owner."""
    store = PostgresStore(dsn, connections=Connections(1, 1), listen=False)
    async with opened(store):
        await store.distribute()


async def empty_jobs(dsn: str) -> None:
    """Delete every job and attempt at `dsn` (on Citus, from every shard)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("TRUNCATE idemproxy.jobs, idemproxy.attempts")
    finally:
        await conn.close()


def record_batches(store: Store) -> list[tuple[str, int]]:
    """Every batched statement the store sends from now on: (kind, rows)."""
    seen: list[tuple[str, int]] = []
    for batcher in store.group_commits():
        batcher.observer = functools.partial(_note_batch, seen, batcher.kind)
    return seen


def _note_batch(seen: list[tuple[str, int]], kind: str, rows: int) -> None:
    seen.append((kind, rows))
