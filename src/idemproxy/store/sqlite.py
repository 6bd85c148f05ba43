"""The embedded SQLite store: the same semantics for a single proxy process (SPEC §11)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiosqlite

from idemproxy.errors import StoreUnavailable
from idemproxy.store.base import Store, settle_states
from idemproxy.store.queries import load_migrations, load_queries
from idemproxy.store.rows import attempt_from_row, encode_headers, job_from_row
from idemproxy.types import ClaimResult, Claimed, Existing, Intent, Job, JobState, StoredResponse


class SqliteStore(Store):
    """One connection; transactions are serialised by an asyncio lock and `BEGIN IMMEDIATE`."""

    def __init__(self, path: str, *, busy_timeout: float = 5.0) -> None:
        super().__init__()
        self._path = path
        self._busy_timeout = busy_timeout
        self._sql = load_queries("sqlite")
        self._db: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        if self._path != ":memory:":
            Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = await aiosqlite.connect(self._path, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            await self._db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
            await self._db.execute("PRAGMA journal_mode = WAL")
            # A claim that a power loss could forget would allow a second execution.
            await self._db.execute("PRAGMA synchronous = FULL")
            await self._db.execute("PRAGMA foreign_keys = ON")
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"Cannot open the SQLite store: {exc}") from exc

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    async def migrate(self) -> list[str]:
        applied: list[str] = []
        async with self._transaction() as db:
            await db.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version TEXT PRIMARY KEY, applied_at REAL NOT NULL DEFAULT (unixepoch()))"
            )
            done = {row[0] for row in await db.execute_fetchall("SELECT version FROM schema_migrations")}
            for version, sql in load_migrations("sqlite"):
                if version not in done:
                    for statement in _statements(sql):
                        await db.execute(statement)
                    await db.execute("INSERT INTO schema_migrations (version) VALUES (?)", (version,))
                    applied.append(version)
        return applied

    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        job_args = {
            "owner": intent.owner, "key": intent.key, "id": job_id,
            "fingerprint": intent.fingerprint, "method": intent.method, "path": intent.path,
            "ttl": float(ttl),
        }
        async with self._transaction() as db:
            cursor = await db.execute(self._sql["insert_job"], job_args)
            created = cursor.rowcount == 1
            if created:
                await db.execute(self._sql["insert_attempt"], {
                    "owner": intent.owner, "job_id": job_id, "number": 1,
                    "upstream": upstream, "lease": float(lease),
                })
            row = await self._one(db, "get_job", {"owner": intent.owner, "key": intent.key})
        assert row is not None, "the job exists inside the claim's transaction"
        job = job_from_row(row)
        return Claimed(job, 1) if created else Existing(job)

    async def get(self, owner: str, key: str) -> Job | None:
        async with self._reading() as db:
            row = await self._one(db, "get_job", {"owner": owner, "key": key})
        return None if row is None else job_from_row(row)

    async def get_by_id(self, job_id: str) -> Job | None:
        async with self._reading() as db:
            row = await self._one(db, "get_job_by_id", {"id": job_id})
            if row is None:
                return None
            attempts = await db.execute_fetchall(self._sql["get_attempts"], {"job_id": job_id})
        return job_from_row(row, tuple(attempt_from_row(a) for a in attempts))

    async def complete(
        self, job: Job, attempt: int, response: StoredResponse, *, ttl: float
    ) -> bool:
        async with self._transaction() as db:
            cursor = await db.execute(self._sql["complete_job"], {
                "id": job.id, "version": job.version, "attempt": attempt,
                "status": response.status, "headers": encode_headers(response.headers),
                "body": response.body, "omitted": response.omitted, "ttl": float(ttl),
            })
            won = cursor.rowcount == 1
            await self._finish_attempt(
                db, job.id, attempt, "succeeded" if won else "discarded", response.status, None
            )
        if won:
            self.watch.notify(job.id)
        return won

    async def settle(
        self, job: Job, attempt: int, state: JobState, *,
        status: int | None = None, error: str | None = None,
    ) -> bool:
        job_state, attempt_state = settle_states(state)
        async with self._transaction() as db:
            cursor = await db.execute(
                self._sql["settle_job"], {"id": job.id, "version": job.version, "state": job_state}
            )
            won = cursor.rowcount == 1
            await self._finish_attempt(db, job.id, attempt, attempt_state, status, error)
        if won:
            self.watch.notify(job.id)
        return won

    async def start_next_attempt(self, job: Job, upstream: str, *, lease: float) -> Claimed | None:
        async with self._transaction() as db:
            cursor = await db.execute(self._sql["reopen_job"], {"id": job.id, "version": job.version})
            if cursor.rowcount != 1:
                return None
            row = await self._one(db, "get_job_by_id", {"id": job.id})
            assert row is not None
            started = job_from_row(row)
            await db.execute(self._sql["insert_attempt"], {
                "owner": job.owner, "job_id": job.id, "number": started.attempt_count,
                "upstream": upstream, "lease": float(lease),
            })
        return Claimed(started, started.attempt_count)

    async def add_attempt(self, job: Job, upstream: str, *, lease: float) -> int | None:
        async with self._transaction() as db:
            cursor = await db.execute(self._sql["count_attempt"], {"id": job.id, "version": job.version})
            if cursor.rowcount != 1:
                return None
            row = await self._one(db, "get_job_by_id", {"id": job.id})
            assert row is not None
            number = int(row["attempt_count"])
            await db.execute(self._sql["insert_attempt"], {
                "owner": job.owner, "job_id": job.id, "number": number,
                "upstream": upstream, "lease": float(lease),
            })
        return number

    async def forget(self, job: Job) -> bool:
        async with self._transaction() as db:
            cursor = await db.execute(self._sql["forget"], {"id": job.id, "version": job.version})
            return cursor.rowcount == 1

    async def sweep_expired(self, batch_size: int) -> int:
        async with self._transaction() as db:
            cursor = await db.execute(self._sql["sweep_expired"], {"limit": batch_size})
            return max(cursor.rowcount, 0)

    async def list_jobs(
        self, *, state: JobState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[Job]:
        params = {"state": state and state.value, "owner": owner, "limit": limit}
        async with self._reading() as db:
            rows = await db.execute_fetchall(self._sql["list_jobs"], params)
        return [job_from_row(row) for row in rows]

    async def ping(self) -> None:
        async with self._reading() as db:
            await db.execute("SELECT 1")

    async def _finish_attempt(
        self, db: aiosqlite.Connection, job_id: str, attempt: int, state: str,
        status: int | None, error: str | None,
    ) -> None:
        await db.execute(self._sql["finish_attempt"], {
            "job_id": job_id, "attempt": attempt, "state": state, "status": status, "error": error,
        })

    async def _one(self, db: aiosqlite.Connection, name: str, params: dict[str, Any]) -> Any:
        async with db.execute(self._sql[name], params) as cursor:
            return await cursor.fetchone()

    @contextlib.asynccontextmanager
    async def _reading(self) -> AsyncIterator[aiosqlite.Connection]:
        async with self._lock, _translate():
            yield self._connection()

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        async with self._lock, _translate():
            db = self._connection()
            await db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                await db.rollback()
                raise
            await db.commit()

    def _connection(self) -> aiosqlite.Connection:
        if self._db is None:
            raise StoreUnavailable("The store is not open.")
        return self._db


@contextlib.asynccontextmanager
async def _translate() -> AsyncIterator[None]:
    """The one place where sqlite3's errors become `StoreUnavailable` (STYLE §4)."""
    try:
        yield
    except (sqlite3.Error, ValueError) as exc:
        raise StoreUnavailable() from exc


def _statements(script: str) -> list[str]:
    return [part.strip() for part in script.split(";") if part.strip()]
