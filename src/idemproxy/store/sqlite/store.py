"""The embedded SQLite store: the same semantics for a single proxy process (SPEC §11)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiosqlite

from idemproxy.constants import DEFAULT_MAX_STORED_BODY
from idemproxy.core.quota import QuotaLimits, QuotaUsage, exceeded, window_start_id
from idemproxy.core.states import attempt_end, settle_states
from idemproxy.core.types import (
    AttemptState,
    Claimed,
    ClaimResult,
    Existing,
    Intent,
    Job,
    JobState,
    StoredResponse,
)
from idemproxy.errors import StoreRefused, StoreUnavailable
from idemproxy.store.base import AttemptFailure, Store
from idemproxy.store.queries import load_migrations, load_queries
from idemproxy.store.reach import sqlite_unopenable
from idemproxy.store.rows import (
    attempt_from_row,
    encode_headers,
    job_from_row,
    late_response_from_row,
)

Params = dict[str, Any]


def _check_directory(path: str) -> None:
    # A missing directory is a typo or a volume that is not mounted: creating it would hide that
    # (the default, idemproxy.db in the working directory, always has one).
    if not Path(path).resolve().parent.is_dir():
        raise sqlite_unopenable(path, "its directory does not exist")


class SqliteStore(Store):
    """One connection; transactions are serialised by an asyncio lock and `BEGIN IMMEDIATE`."""

    def __init__(
        self, path: str, *, busy_timeout: float = 5.0, late_bytes: int = DEFAULT_MAX_STORED_BODY
    ) -> None:
        super().__init__()
        self._late_bytes = late_bytes  # kept late bodies per job in all (SPEC §3.3)
        self._path = path
        self._busy_timeout = busy_timeout
        self._sql = load_queries("sqlite")
        self._db: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        if self._path != ":memory:":
            _check_directory(self._path)
        try:
            self._db = await aiosqlite.connect(self._path, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            await self._db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
            await self._db.execute("PRAGMA journal_mode = WAL")
            # A claim that a power loss could forget would allow a second execution.
            await self._db.execute("PRAGMA synchronous = FULL")
            await self._db.execute("PRAGMA foreign_keys = ON")
        except sqlite3.Error as exc:
            raise sqlite_unopenable(self._path, str(exc)) from exc

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
            rows = await db.execute_fetchall("SELECT version FROM schema_migrations")
            done = {row[0] for row in rows}
            for version, sql in load_migrations("sqlite"):
                if version not in done:
                    for statement in _statements(sql):
                        await db.execute(statement)
                    await db.execute(
                        "INSERT INTO schema_migrations (version) VALUES (?)", (version,)
                    )
                    applied.append(version)
        return applied

    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        job_args = {
            "owner": intent.owner,
            "key": intent.key,
            "id": job_id,
            "fingerprint": intent.fingerprint,
            "method": intent.method,
            "path": intent.path,
            "ttl": float(ttl),
            "lease": float(lease),
        }
        async with self._transaction("claim") as db:
            created = await self._changed(db, "insert_job", job_args)
            if created:
                await self._insert_attempt(
                    db, _new_attempt(intent.owner, job_id, 1, upstream, lease)
                )
            row = await self._one(db, "get_job", {"owner": intent.owner, "key": intent.key})
        assert row is not None, "the job exists inside the claim's transaction"
        job = job_from_row(row)
        return Claimed(job, 1) if created else Existing(job)

    async def claim_within(
        self,
        intent: Intent,
        job_id: str,
        upstream: str,
        *,
        ttl: float,
        lease: float,
        limits: QuotaLimits,
    ) -> ClaimResult | str:
        # SPEC §9: BEGIN IMMEDIATE makes this the only writer, so the count holds until the
        # insert (the SQLite store serves one process; its claims queue on one connection).
        async with self._transaction("claim_quota") as db:
            params = {
                "owner": intent.owner,
                "key": intent.key,
                "since": window_start_id(),
                "bytes": limits.stored_bytes is not None,
            }
            usage = await self._one(db, "quota_usage", params)
            limit = None
            if not usage["taken"]:
                counted = QuotaUsage(usage["in_flight"], usage["recent"], usage["stored_bytes"])
                limit = exceeded(limits, counted)
        if limit is not None:
            return limit
        return await self.claim(intent, job_id, upstream, ttl=ttl, lease=lease)

    async def get(self, owner: str, key: str) -> Job | None:
        async with self._reading("get_job") as db:
            row = await self._one(db, "get_job", {"owner": owner, "key": key})
        return None if row is None else job_from_row(row)

    async def watch_job(self, owner: str, key: str) -> Job | None:
        return await self.get(owner, key)  # every change is announced in-process anyway

    async def complete(
        self, job: Job, attempt: int, response: StoredResponse, *, ttl: float
    ) -> bool:
        params = _cas(job) | {
            "attempt": attempt,
            "status": response.status,
            "ttl": float(ttl),
            "headers": encode_headers(response.headers),
            "body": response.body,
            "omitted": response.omitted,
        }
        async with self._transaction("complete") as db:
            won = await self._changed(db, "complete_job", params)
            attempt_row = {"owner": job.owner, "job_id": job.id, "attempt": attempt}
            if won:
                await db.execute(
                    self._sql["succeed_attempt"], attempt_row | {"status": response.status}
                )
            else:
                await self._discard(db, attempt_row, response)
        return self._notify_if(won, job)

    async def _discard(
        self, db: aiosqlite.Connection, attempt_row: Params, response: StoredResponse
    ) -> None:
        """A late result: the attempt is `discarded`; its response is kept on it when the job
        was taken over, within the bound (queries.sql `discard_attempt`)."""
        keep = False
        if response.body is not None:
            bound = {"body_bytes": len(response.body), "kept_limit": self._late_bytes}
            row = await self._one(db, "may_keep_late", attempt_row | bound)
            keep = bool(row["keep"])
        params = attempt_row | {
            "status": response.status,
            "keep": keep,
            "headers": encode_headers(response.headers),
            "body": response.body,
        }
        await db.execute(self._sql["discard_attempt"], params)

    async def settle(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> bool:
        job_state, attempt_state = settle_states(state)
        async with self._transaction("settle") as db:
            won = await self._changed(db, "settle_job", _cas(job) | {"state": job_state.value})
            await self._finish(db, job, attempt, attempt_state, AttemptFailure(status, error))
        return self._notify_if(won, job)

    async def finish_attempt(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> None:
        async with self._transaction() as db:
            await self._finish(db, job, attempt, attempt_end(state), AttemptFailure(status, error))

    async def start_next_attempt(self, job: Job, upstream: str, *, lease: float) -> Claimed | None:
        async with self._transaction() as db:
            if not await self._changed(db, "reopen_job", _cas(job) | {"lease": float(lease)}):
                return None
            return await self._started(db, job, upstream, lease)

    async def fail_over(
        self,
        job: Job,
        attempt: int,
        upstream: str,
        *,
        failure: AttemptFailure,
        lease: float,
    ) -> Claimed | None:
        async with self._transaction() as db:
            if not await self._changed(db, "advance_job", _cas(job) | {"lease": float(lease)}):
                return None
            await self._finish(db, job, attempt, attempt_end(JobState.RELEASED), failure)
            return await self._started(db, job, upstream, lease)

    async def add_attempt(self, job: Job, upstream: str, *, lease: float) -> int | None:
        async with self._transaction() as db:
            if not await self._changed(db, "count_attempt", _cas(job) | {"lease": float(lease)}):
                return None
            started = await self._started(db, job, upstream, lease)
        return started.attempt

    async def renew_lease(self, job: Job, *, lease: float) -> bool:
        params = _cas(job) | {"lease": float(lease)}
        async with self._transaction() as db:
            renewed = await self._changed(db, "renew_job_lease", params)
            if renewed:
                await db.execute(self._sql["renew_attempt_leases"], params)
        return renewed

    async def take_over(self, job: Job) -> bool:
        async with self._transaction() as db:
            won = await self._changed(db, "take_over_job", _cas(job))
            if won:
                await db.execute(self._sql["lose_attempts"], {"owner": job.owner, "id": job.id})
        return self._notify_if(won, job)

    async def forget(self, job: Job) -> bool:
        async with self._transaction() as db:
            return await self._changed(db, "forget", _cas(job))

    async def get_by_id(self, job_id: str) -> Job | None:
        async with self._reading() as db:
            row = await self._one(db, "get_job_by_id", {"id": job_id})
            if row is None:
                return None
            attempts = await db.execute_fetchall(
                self._sql["get_attempts"], {"owner": row["owner"], "job_id": job_id}
            )
        return job_from_row(row, tuple(attempt_from_row(a) for a in attempts))

    async def late_response(self, job: Job, attempt: int) -> StoredResponse | None:
        params = {"owner": job.owner, "job_id": job.id, "number": attempt}
        async with self._reading("late_response") as db:
            row = await self._one(db, "get_late_response", params)
        return None if row is None else late_response_from_row(row)

    async def resolve(
        self,
        job: Job,
        state: JobState,
        *,
        response: StoredResponse | None = None,
        ttl: float = 0.0,
        resolution: str = "operator",
    ) -> bool:
        params = _cas(job) | {"resolution": resolution}
        if state is JobState.RELEASED:
            query = "resolve_released"
        elif state is JobState.COMPLETED and response is not None and response.body is not None:
            query = "resolve_completed"
            params |= {
                "status": response.status,
                "headers": encode_headers(response.headers),
                "body": response.body,
                "ttl": float(ttl),
            }
        else:
            raise ValueError("resolve as completed needs a response with a body")
        async with self._transaction() as db:
            won = await self._changed(db, query, params)
        return self._notify_if(won, job)

    async def delete(self, job: Job, *, force: bool = False) -> bool:
        async with self._transaction() as db:
            won = await self._changed(db, "delete_job", _cas(job) | {"force": force})
        return self._notify_if(won, job)

    async def stale_unknown(self, older_than: float, limit: int) -> list[Job]:
        async with self._reading() as db:
            rows = await db.execute_fetchall(
                self._sql["stale_unknown"], {"age": float(older_than), "limit": limit}
            )
        return [job_from_row(row) for row in rows]

    async def expired_leases(self, older_than: float, limit: int) -> list[Job]:
        async with self._reading("expired_leases") as db:
            rows = await db.execute_fetchall(
                self._sql["expired_leases"], {"grace": float(older_than), "limit": limit}
            )
        return [job_from_row(row) for row in rows]

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

    async def owner_jobs(
        self, owner: str, *, after: str, before: datetime, limit: int
    ) -> list[Job]:
        params = {"owner": owner, "after": after, "before": before.timestamp(), "limit": limit}
        async with self._reading() as db:
            rows = await db.execute_fetchall(self._sql["owner_jobs"], params)
        return [job_from_row(row) for row in rows]

    async def count_unknown(self) -> int:
        async with self._reading() as db:
            row = await self._one(db, "count_unknown", {})
        return int(row["unknown"])

    async def ping(self) -> None:
        async with self._reading() as db:
            await db.execute("SELECT 1")

    def _notify_if(self, won: bool, job: Job) -> bool:
        """Held duplicates in this process learn of the change after the commit."""
        if won:
            self.watch.notify(job.id)
        return won

    async def _started(
        self, db: aiosqlite.Connection, job: Job, upstream: str, lease: float
    ) -> Claimed:
        row = await self._one(db, "get_job_by_id", {"id": job.id})
        assert row is not None, "the job exists inside the transaction"
        started = job_from_row(row)
        number = started.attempt_count
        await self._insert_attempt(db, _new_attempt(job.owner, job.id, number, upstream, lease))
        return Claimed(started, number)

    async def _insert_attempt(self, db: aiosqlite.Connection, attempt: Params) -> None:
        await db.execute(self._sql["insert_attempt"], attempt)

    async def _finish(
        self,
        db: aiosqlite.Connection,
        job: Job,
        attempt: int,
        state: AttemptState,
        failure: AttemptFailure,
    ) -> None:
        await db.execute(
            self._sql["finish_attempt"],
            {
                "owner": job.owner,
                "job_id": job.id,
                "attempt": attempt,
                "state": state.value,
                "status": failure.status,
                "error": failure.error,
            },
        )

    async def _changed(self, db: aiosqlite.Connection, name: str, params: Params) -> bool:
        cursor = await db.execute(self._sql[name], params)
        return cursor.rowcount == 1

    async def _one(self, db: aiosqlite.Connection, name: str, params: Params) -> Any:
        async with db.execute(self._sql[name], params) as cursor:
            return await cursor.fetchone()

    @contextlib.asynccontextmanager
    async def _reading(self, what: str = "read") -> AsyncIterator[aiosqlite.Connection]:
        with self.observed(what):
            async with self._lock, _translate():
                yield self._connection()

    @contextlib.asynccontextmanager
    async def _transaction(self, what: str = "write") -> AsyncIterator[aiosqlite.Connection]:
        with self.observed(what):
            async with self._transaction_unobserved() as db:
                yield db

    @contextlib.asynccontextmanager
    async def _transaction_unobserved(self) -> AsyncIterator[aiosqlite.Connection]:
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


def _cas(job: Job) -> Params:
    return {"owner": job.owner, "id": job.id, "version": job.version}


def _new_attempt(owner: str, job_id: str, number: int, upstream: str, lease: float) -> Params:
    """The row `insert_attempt` adds: attempt `number` of the job, on `upstream`."""
    return {
        "owner": owner,
        "job_id": job_id,
        "number": number,
        "upstream": upstream,
        "lease": float(lease),
    }


@contextlib.asynccontextmanager
async def _translate() -> AsyncIterator[None]:
    """The one place where sqlite3's errors become `StoreUnavailable`, so no driver error reaches
    the proxy."""
    try:
        yield
    except (sqlite3.DataError, sqlite3.IntegrityError, UnicodeError) as exc:
        # This statement's data (a text that is not UTF-8 among them), not the store's health.
        raise StoreRefused() from exc
    except (sqlite3.Error, ValueError) as exc:
        raise StoreUnavailable() from exc


def _statements(script: str) -> list[str]:
    return [part.strip() for part in script.split(";") if part.strip()]
