"""The embedded SQLite store: the same semantics for a single proxy process (SPEC §11)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

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
    KeptResponse,
    SealedResponse,
)
from idemproxy.errors import StoreRefused, StoreUnavailable
from idemproxy.store.base import AttemptFailure, LateResponse, Store, key_of
from idemproxy.store.batching import (
    DEFAULT_BATCH,
    ClaimRequest,
    CompleteRequest,
    GroupCommit,
    complete_distinct,
    complete_size,
)
from idemproxy.store.queries import load_migrations, load_queries
from idemproxy.store.reach import sqlite_unopenable
from idemproxy.store.rows import (
    attempt_from_row,
    job_from_row,
    late_from_row,
    late_response_from_row,
    response_columns,
)

Params = dict[str, Any]
Request = TypeVar("Request")
Result = TypeVar("Result")
# One row of a batch, run inside the batch's transaction.
RowWrite = Callable[[aiosqlite.Connection, Request], Awaitable[Result]]


def _check_directory(path: str) -> None:
    # A missing directory is a typo or a volume that is not mounted: creating it would hide that
    # (the default, idemproxy.db in the working directory, always has one).
    if not Path(path).resolve().parent.is_dir():
        raise sqlite_unopenable(path, "its directory does not exist")


class SqliteStore(Store):
    """One connection; transactions are serialised by an asyncio lock and `BEGIN IMMEDIATE`.

    Claims and completions are group-committed (store/batching.py): those that queue while the
    connection is busy share one transaction and one fsync (`synchronous = FULL` stays), each
    row in a savepoint of its own, so that one row's error is only its caller's.
    """

    def __init__(
        self,
        path: str,
        *,
        busy_timeout: float = 5.0,
        late_bytes: int = DEFAULT_MAX_STORED_BODY,
        batch: int = DEFAULT_BATCH,
    ) -> None:
        super().__init__()
        self._late_bytes = late_bytes  # kept late bodies per job in all (SPEC §3.3)
        self._path = path
        self._busy_timeout = busy_timeout
        self._sql = load_queries("sqlite")
        self._db: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()
        # One process, one connection: no routing to keep, so every owner shares the batches.
        self.claims = GroupCommit[ClaimRequest, ClaimResult](
            "claim", self._claim_batch, group=_one_group, distinct=_claim_key, limit=batch
        )
        self.completions = GroupCommit[CompleteRequest, bool](
            "complete",
            self._complete_batch,
            group=_one_group,
            distinct=complete_distinct,
            limit=batch,
            size=complete_size,
        )
        # One connection: a second statement would only wait for the first one's lock.
        self.claims.in_flight = self.completions.in_flight = 1

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
        await self.claims.close()
        await self.completions.close()
        if self._db is not None:
            await self._db.close()
            self._db = None

    def group_commits(self) -> tuple[GroupCommit[Any, Any], ...]:
        return self.claims, self.completions

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
        request = ClaimRequest(intent, job_id, upstream, float(ttl), float(lease))
        with self.observed("claim"):
            return await self.claims.submit(request)

    async def _claim_batch(self, batch: list[ClaimRequest]) -> list[ClaimResult | BaseException]:
        return await self._batch(batch, self._claim_row)

    async def _claim_row(self, db: aiosqlite.Connection, request: ClaimRequest) -> ClaimResult:
        intent = request.intent
        job_args = {
            "owner": intent.owner,
            "key": intent.key,
            "id": request.job_id,
            "fingerprint": intent.fingerprint,
            "method": intent.method,
            "path": intent.path,
            "ttl": request.ttl,
            "lease": request.lease,
        }
        created = await self._changed(db, "insert_job", job_args)
        if created:
            await self._insert_attempt(
                db, _new_attempt(intent.owner, request.job_id, 1, request.upstream, request.lease)
            )
        row = await self._one(db, "get_job", {"owner": intent.owner, "key": intent.key})
        assert row is not None, "the job exists inside the claim's transaction"
        job = job_from_row(row)
        return Claimed(job, 1) if created else Existing(job)

    async def _batch(
        self, batch: list[Request], write: RowWrite[Request, Result]
    ) -> list[Result | BaseException]:
        """One transaction and one commit for the whole batch; each row in a savepoint, so
        that a row the database refuses fails only its own caller (SPEC §11)."""
        results: list[Result | BaseException] = []
        async with self._transaction_unobserved() as db:
            if len(batch) == 1:
                return [await write(db, batch[0])]
            for request in batch:
                await db.execute("SAVEPOINT batch_row")
                try:
                    async with _translate():
                        results.append(await write(db, request))
                except StoreUnavailable as exc:
                    await db.execute("ROLLBACK TO batch_row")
                    results.append(exc)
                await db.execute("RELEASE batch_row")
        return results

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
        # SPEC §9: BEGIN IMMEDIATE makes this the only writer, and the claim is written in the
        # same transaction: requests counted at once cannot all pass the count before any of
        # them is claimed.
        request = ClaimRequest(intent, job_id, upstream, float(ttl), float(lease))
        async with self._transaction("claim_quota") as db:
            params = {
                "owner": intent.owner,
                "key": intent.key,
                "since": window_start_id(),
                "bytes": limits.stored_bytes is not None,
            }
            usage = await self._one(db, "quota_usage", params)
            if not usage["taken"]:
                counted = QuotaUsage(
                    usage["in_flight"], usage["recent"], usage["stored_bytes"], usage["pending"]
                )
                limit = exceeded(limits, counted)
                if limit is not None:
                    return limit
            return await self._claim_row(db, request)

    async def get(self, owner: str, key: str) -> Job | None:
        async with self._reading("get_job") as db:
            row = await self._one(db, "get_job", {"owner": owner, "key": key})
        return None if row is None else job_from_row(row)

    async def watch_job(self, owner: str, key: str) -> Job | None:
        return await self.get(owner, key)  # every change is announced in-process anyway

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        with self.observed("complete"):
            won = await self.completions.submit(CompleteRequest(job, attempt, response, ttl))
        return self._notify_if(won, job)

    async def _complete_batch(self, batch: list[CompleteRequest]) -> list[bool | BaseException]:
        return await self._batch(batch, self._complete_row)

    async def _complete_row(self, db: aiosqlite.Connection, request: CompleteRequest) -> bool:
        job, response = request.job, request.response
        headers, body, key_id = response_columns(response)
        params = _cas(job) | {
            "attempt": request.attempt,
            "status": response.status,
            "ttl": float(request.ttl),
            "headers": headers,
            "body": body,
            "omitted": response.omitted,
            "key_id": key_id,
        }
        won = await self._changed(db, "complete_job", params)
        attempt_row = {"owner": job.owner, "job_id": job.id, "attempt": request.attempt}
        if won:
            await db.execute(
                self._sql["succeed_attempt"], attempt_row | {"status": response.status}
            )
        else:
            await self._discard(db, attempt_row, response)
        return won

    async def _discard(
        self, db: aiosqlite.Connection, attempt_row: Params, response: KeptResponse
    ) -> None:
        """A late result: the attempt is `discarded`; its response is kept on it when the job
        was taken over, within the bound (queries.sql `discard_attempt`)."""
        keep = False
        headers, body, key_id = response_columns(response)
        if body is not None and not response.omitted:
            bound = {"body_bytes": len(body), "kept_limit": self._late_bytes}
            row = await self._one(db, "may_keep_late", attempt_row | bound)
            keep = bool(row["keep"])
        params = attempt_row | {
            "status": response.status,
            "keep": keep,
            "headers": headers,
            "body": body,
            "key_id": key_id,
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

    async def late_response(self, job: Job, attempt: int) -> KeptResponse | None:
        params = {"owner": job.owner, "job_id": job.id, "number": attempt}
        async with self._reading("late_response") as db:
            row = await self._one(db, "get_late_response", params)
        return None if row is None else late_response_from_row(row)

    async def resolve(
        self,
        job: Job,
        state: JobState,
        *,
        response: KeptResponse | None = None,
        ttl: float = 0.0,
        resolution: str = "operator",
    ) -> bool:
        params = _cas(job) | {"resolution": resolution}
        if state is JobState.RELEASED:
            query = "resolve_released"
        elif state is JobState.COMPLETED and response is not None and not response.omitted:
            query = "resolve_completed"
            headers, body, key_id = response_columns(response)
            params |= {
                "status": response.status,
                "headers": headers,
                "body": body,
                "key_id": key_id,
                "ttl": float(ttl),
            }
        else:
            raise ValueError("resolve as completed needs a response with a body")
        async with self._transaction() as db:
            won = await self._changed(db, query, params)
        return self._notify_if(won, job)

    async def to_reseal(self, primary: str | None, after: Job | None, limit: int) -> list[Job]:
        params = {"primary": primary, "limit": limit, "owner": "", "id": ""}
        if after is not None:
            params |= {"owner": after.owner, "id": after.id}
        async with self._reading("to_reseal") as db:
            rows = await db.execute_fetchall(self._sql["responses_to_reseal"], params)
        return [job_from_row(row) for row in rows]

    async def reseal(self, job: Job, sealed: SealedResponse) -> bool:
        params = _cas(job) | {
            "read_with": key_of(job.response),
            "box": sealed.sealed,
            "key_id": sealed.key_id,
        }
        async with self._transaction("reseal") as db:
            return await self._changed(db, "reseal_response", params)

    async def late_to_reseal(
        self, primary: str | None, after: LateResponse | None, limit: int
    ) -> list[LateResponse]:
        params: Params = {"primary": primary, "limit": limit, "owner": "", "id": "", "number": 0}
        if after is not None:
            params |= {"owner": after.owner, "id": after.job_id, "number": after.number}
        async with self._reading("late_to_reseal") as db:
            rows = await db.execute_fetchall(self._sql["late_responses_to_reseal"], params)
        return [late_from_row(row) for row in rows]

    async def reseal_late(self, late: LateResponse, sealed: SealedResponse) -> bool:
        params = {
            "owner": late.owner,
            "job_id": late.job_id,
            "number": late.number,
            "read_with": key_of(late.response),
            "box": sealed.sealed,
            "key_id": sealed.key_id,
        }
        async with self._transaction("reseal") as db:
            return await self._changed(db, "reseal_late_response", params)

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


def _one_group(_request: object) -> None:
    return None


def _claim_key(request: ClaimRequest) -> tuple[str, str]:
    return request.intent.owner, request.intent.key


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
