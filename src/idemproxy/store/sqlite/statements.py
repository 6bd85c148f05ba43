"""The SQLite store's operations as synchronous functions of its connection.

Each runs whole on the connection's thread (worker.py), a write inside the one transaction
`Worker.transact` gives it, so that an operation of several statements, or a batch of many
rows, costs the event loop one hop to the thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from idemproxy.core.quota import QuotaLimits, QuotaUsage, exceeded, window_start_id
from idemproxy.core.types import AttemptState, Claimed, ClaimResult, Existing, Job, KeptResponse
from idemproxy.errors import StoreRefused, StoreUnavailable
from idemproxy.store.base import AttemptFailure
from idemproxy.store.batching import ClaimRequest, CompleteRequest
from idemproxy.store.queries import load_migrations
from idemproxy.store.rows import attempt_from_row, job_from_row, response_columns

log = logging.getLogger("idemproxy.store")

Params = dict[str, Any]
Request = TypeVar("Request")
Result = TypeVar("Result")
# One row of a batch, run inside the batch's transaction.
RowWrite = Callable[[sqlite3.Connection, Request], Result]


class Statements:
    """The named queries (store/sql/sqlite/queries.sql), run on one connection."""

    def __init__(self, sql: dict[str, str], late_bytes: int) -> None:
        self._sql = sql
        self._late_bytes = late_bytes  # kept late bodies per job in all (SPEC §3.3)

    # --- generic ------------------------------------------------------------------------------

    def changed(self, db: sqlite3.Connection, name: str, params: Params) -> bool:
        return db.execute(self._sql[name], params).rowcount == 1

    def one(self, db: sqlite3.Connection, name: str, params: Params) -> Any:
        return db.execute(self._sql[name], params).fetchone()

    def rows(self, db: sqlite3.Connection, name: str, params: Params) -> list[Any]:
        return db.execute(self._sql[name], params).fetchall()

    def jobs(self, db: sqlite3.Connection, name: str, params: Params) -> list[Job]:
        return [job_from_row(row) for row in self.rows(db, name, params)]

    def job(self, db: sqlite3.Connection, name: str, params: Params) -> Job | None:
        row = self.one(db, name, params)
        return None if row is None else job_from_row(row)

    def count(self, db: sqlite3.Connection, name: str, params: Params) -> int:
        return max(db.execute(self._sql[name], params).rowcount, 0)

    # --- batches ------------------------------------------------------------------------------

    def batch(
        self, db: sqlite3.Connection, write: RowWrite[Request, Result], batch: list[Request]
    ) -> list[Result | BaseException]:
        """Every row of a batch in the one transaction, each in a savepoint, so that a row the
        database refuses fails only its own caller, with the error it would have had alone
        (SPEC §11)."""
        if len(batch) == 1:
            return [write(db, batch[0])]
        results: list[Result | BaseException] = []
        for request in batch:
            db.execute("SAVEPOINT batch_row")
            try:
                with translate():
                    results.append(write(db, request))
            except StoreUnavailable as exc:
                db.execute("ROLLBACK TO batch_row")
                results.append(exc)
            db.execute("RELEASE batch_row")
        return results

    def claim(self, db: sqlite3.Connection, request: ClaimRequest) -> ClaimResult:
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
        created = self.changed(db, "insert_job", job_args)
        if created:
            self._insert_attempt(
                db, _new_attempt(intent.owner, request.job_id, 1, request.upstream, request.lease)
            )
        job = self.job(db, "get_job", {"owner": intent.owner, "key": intent.key})
        assert job is not None, "the job exists inside the claim's transaction"
        return Claimed(job, 1) if created else Existing(job)

    def claim_within(
        self, db: sqlite3.Connection, request: ClaimRequest, limits: QuotaLimits
    ) -> ClaimResult | str:
        # SPEC §9: BEGIN IMMEDIATE makes this the only writer, and the claim is written in the
        # same transaction: requests counted at once cannot all pass the count before any of
        # them is claimed.
        intent = request.intent
        params = {
            "owner": intent.owner,
            "key": intent.key,
            "since": window_start_id(),
            "bytes": limits.stored_bytes is not None,
        }
        usage = self.one(db, "quota_usage", params)
        if not usage["taken"]:
            counted = QuotaUsage(
                usage["in_flight"], usage["recent"], usage["stored_bytes"], usage["pending"]
            )
            limit = exceeded(limits, counted)
            if limit is not None:
                return limit
        return self.claim(db, request)

    def complete(self, db: sqlite3.Connection, request: CompleteRequest) -> bool:
        job, response = request.job, request.response
        headers, body, key_id, omitted = response_columns(response)
        params = cas(job) | {
            "attempt": request.attempt,
            "status": response.status,
            "ttl": float(request.ttl),
            "headers": headers,
            "body": body,
            "omitted": omitted,
            "key_id": key_id,
        }
        won = self.changed(db, "complete_job", params)
        attempt_row = {"owner": job.owner, "job_id": job.id, "attempt": request.attempt}
        if won:
            db.execute(self._sql["succeed_attempt"], attempt_row | {"status": response.status})
        else:
            self._discard(db, attempt_row, response)
        return won

    def _discard(self, db: sqlite3.Connection, attempt_row: Params, response: KeptResponse) -> None:
        """A late result: the attempt is `discarded`; its response is kept on it when the job
        was taken over, within the bound (queries.sql `discard_attempt`)."""
        keep = False
        headers, body, key_id, omitted = response_columns(response)
        if body is not None and not omitted:
            bound = {"body_bytes": len(body), "kept_limit": self._late_bytes}
            keep = bool(self.one(db, "may_keep_late", attempt_row | bound)["keep"])
        params = attempt_row | {
            "status": response.status,
            "keep": keep,
            "headers": headers,
            "body": body,
            "key_id": key_id,
        }
        db.execute(self._sql["discard_attempt"], params)

    # --- attempts -----------------------------------------------------------------------------

    def settle(
        self,
        db: sqlite3.Connection,
        job: Job,
        attempt: int,
        states: tuple[str, AttemptState],
        failure: AttemptFailure,
    ) -> bool:
        won = self.changed(db, "settle_job", cas(job) | {"state": states[0]})
        self.finish(db, job, attempt, states[1], failure)
        return won

    def finish(
        self,
        db: sqlite3.Connection,
        job: Job,
        attempt: int,
        state: AttemptState,
        failure: AttemptFailure,
    ) -> None:
        params = {
            "owner": job.owner,
            "job_id": job.id,
            "attempt": attempt,
            "state": state.value,
            "status": failure.status,
            "error": failure.error,
        }
        db.execute(self._sql["finish_attempt"], params)

    def next_attempt(
        self,
        db: sqlite3.Connection,
        name: str,
        job: Job,
        upstream: str,
        lease: float,
        token: str | None = None,
    ) -> Claimed | None:
        """`name` (`reopen_job`, `count_attempt`) moves the job on; then a new attempt.
        `token`: the job's `started_by` (`reopen_job` only)."""
        if not self.changed(db, name, cas(job) | {"lease": lease, "started_by": token}):
            return None
        return self._started(db, job, upstream, lease)

    def resend(
        self,
        db: sqlite3.Connection,
        job: Job,
        upstream: str,
        lease: float,
        token: str,
        fields: Params,
    ) -> Claimed | None:
        """SPEC §3.6: `resend_job` moves the unknown job back in flight; then a new attempt."""
        params = cas(job) | {"lease": lease, "started_by": token} | fields
        if not self.changed(db, "resend_job", params):
            return None
        return self._started(db, job, upstream, lease)

    def fail_over(
        self,
        db: sqlite3.Connection,
        job: Job,
        attempt: int,
        upstream: str,
        failure: tuple[AttemptState, AttemptFailure],
        started: tuple[float, str | None],
    ) -> Claimed | None:
        """`started`: the next attempt's lease, and the token recorded as `started_by`."""
        lease, token = started
        if not self.changed(db, "advance_job", cas(job) | {"lease": lease, "started_by": token}):
            return None
        self.finish(db, job, attempt, *failure)
        return self._started(db, job, upstream, lease)

    def renew_lease(self, db: sqlite3.Connection, job: Job, lease: float) -> bool:
        params = cas(job) | {"lease": lease}
        renewed = self.changed(db, "renew_job_lease", params)
        if renewed:
            db.execute(self._sql["renew_attempt_leases"], params)
        return renewed

    def take_over(self, db: sqlite3.Connection, job: Job) -> bool:
        won = self.changed(db, "take_over_job", cas(job))
        if won:
            db.execute(self._sql["lose_attempts"], {"owner": job.owner, "id": job.id})
        return won

    def job_with_attempts(self, db: sqlite3.Connection, job_id: str) -> Job | None:
        row = self.one(db, "get_job_by_id", {"id": job_id})
        if row is None:
            return None
        attempts = self.rows(db, "get_attempts", {"owner": row["owner"], "job_id": job_id})
        return job_from_row(row, tuple(attempt_from_row(a) for a in attempts))

    def _started(self, db: sqlite3.Connection, job: Job, upstream: str, lease: float) -> Claimed:
        started = self.job(db, "get_job_by_id", {"id": job.id})
        assert started is not None, "the job exists inside the transaction"
        number = started.attempt_count
        self._insert_attempt(db, _new_attempt(job.owner, job.id, number, upstream, lease))
        return Claimed(started, number)

    def _insert_attempt(self, db: sqlite3.Connection, attempt: Params) -> None:
        db.execute(self._sql["insert_attempt"], attempt)


def migrate(db: sqlite3.Connection) -> list[str]:
    applied: list[str] = []
    db.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version TEXT PRIMARY KEY, applied_at REAL NOT NULL DEFAULT (unixepoch()))"
    )
    done = {row[0] for row in db.execute("SELECT version FROM schema_migrations")}
    for version, sql in load_migrations("sqlite"):
        if version not in done:
            for statement in _statements(sql):
                db.execute(statement)
            db.execute("INSERT INTO schema_migrations (version) VALUES (?)", (version,))
            applied.append(version)
    return applied


def ping(db: sqlite3.Connection) -> None:
    db.execute("SELECT 1").fetchone()


def opened_read_only(db: sqlite3.Connection, sql: str) -> bool:
    """Whether SQLite opened the file for reading only (one the process may not write, or on a
    file system mounted read-only), which it does without a word: a write that changes nothing
    (`sql`, queries.sql `read_only`) is refused. Asked once, at open: such a connection stays
    read-only (a restart opens it anew), and the write waits for any other writer's lock."""
    try:
        db.execute(sql)
    except sqlite3.OperationalError as exc:
        if exc.sqlite_errorcode == sqlite3.SQLITE_READONLY:
            return True
        if "no such table" not in str(exc):  # a file not migrated yet: its migration tells
            raise
    return False


def on_read_only_mount(path: str) -> bool:
    """Whether the file system holding `path` is mounted read-only now (as Linux remounts one
    after I/O errors): the open connection's next write fails."""
    if path == ":memory:":
        return False
    return bool(os.statvfs(os.path.dirname(os.path.abspath(path))).f_flag & os.ST_RDONLY)


def cas(job: Job) -> Params:
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


@contextlib.contextmanager
def translate() -> Iterator[None]:
    """The one place where sqlite3's errors become `StoreUnavailable`, so no driver error reaches
    the proxy (around a batch's row on the thread, around every call to it on the loop)."""
    try:
        yield
    except (sqlite3.DataError, sqlite3.IntegrityError, UnicodeError) as exc:
        # This statement's data (a text that is not UTF-8 among them), not the store's health.
        _said(exc)
        raise StoreRefused() from exc
    except (sqlite3.Error, ValueError) as exc:
        # `database or disk is full`, `attempt to write a readonly database`, `disk I/O
        # error`: the one line an operator has to go on, as the PostgreSQL store's.
        _said(exc)
        raise StoreUnavailable() from exc


def _said(exc: BaseException) -> None:
    # SPEC §11: fail closed; the detail goes to the log, never to the client.
    log.warning("store error: %s: %s", type(exc).__name__, exc)


def _statements(script: str) -> list[str]:
    return [part.strip() for part in script.split(";") if part.strip()]
