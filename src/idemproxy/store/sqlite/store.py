"""The embedded SQLite store: the same semantics for a single proxy process (SPEC §11)."""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple, Unpack

from idemproxy.constants import DEFAULT_MAX_STORED_BODY, MAX_EVIDENCE_ENTRIES
from idemproxy.core.quota import QuotaLimits
from idemproxy.core.resolution import Backoff
from idemproxy.core.states import attempt_end, settle_states
from idemproxy.core.types import (
    Claimed,
    ClaimResult,
    Evidence,
    Intent,
    Job,
    JobState,
    KeptResponse,
    SealedResponse,
)
from idemproxy.errors import StoreUnavailable
from idemproxy.store.base import AttemptFailure, LateResponse, Store, key_of
from idemproxy.store.batching import (
    DEFAULT_BATCH,
    ClaimRequest,
    CompleteRequest,
    GroupCommit,
    complete_distinct,
    complete_size,
)
from idemproxy.store.queries import load_queries
from idemproxy.store.reach import sqlite_unopenable
from idemproxy.store.rows import (
    evidence_to_json,
    late_from_row,
    late_response_from_row,
    response_columns,
)
from idemproxy.store.sqlite.statements import (
    Params,
    Statements,
    cas,
    migrate,
    on_read_only_mount,
    opened_read_only,
    ping,
    translate,
)
from idemproxy.store.sqlite.worker import Worker

log = logging.getLogger(__name__)

Result = TypeVar("Result")
Args = TypeVarTuple("Args")
# A claim that a power loss could forget would allow a second execution: synchronous = FULL.
PRAGMAS = ("journal_mode = WAL", "synchronous = FULL", "foreign_keys = ON")


def _check_directory(path: str) -> None:
    # A missing directory is a typo or a volume that is not mounted: creating it would hide that
    # (the default, idemproxy.db in the working directory, always has one).
    if not Path(path).resolve().parent.is_dir():
        raise sqlite_unopenable(path, "its directory does not exist")


class SqliteStore(Store):
    """One connection, on a thread of its own (worker.py): every operation is one synchronous
    function run there whole, a write in one `BEGIN IMMEDIATE` transaction; the thread runs
    them one after the other, so no two transactions interleave.

    Claims and completions are group-committed (store/batching.py): those that queue while the
    connection is busy share one transaction and one fsync (`synchronous = FULL` stays), each
    row in a savepoint of its own, so that one row's error is only its caller's; a batch is one
    hop to the thread, however many rows it has.
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
        self._path = path
        self._file: tuple[int, int] | None = None  # the open file's device and inode
        # Its write-ahead log and shared-memory index, once they exist (WAL mode): the commits
        # not yet checkpointed live in the log, so a log deleted or replaced loses them too.
        self._companions: list[tuple[int, int] | None] = [None, None]
        self._gone_logged = False
        self._read_only = False  # SQLite opened the file for reading only (`open`)
        self._busy_timeout = busy_timeout
        self._sql = load_queries("sqlite")
        self._q = Statements(self._sql, late_bytes)
        self.worker = Worker()
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
        # One connection: a second batch would only wait on the thread behind the first.
        self.claims.in_flight = self.completions.in_flight = 1

    async def open(self) -> None:
        if self._path != ":memory:":
            _check_directory(self._path)
        pragmas = [f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}"]
        pragmas += [f"PRAGMA {pragma}" for pragma in PRAGMAS]
        try:
            await self.worker.open(self._path, pragmas)
        except sqlite3.Error as exc:
            raise sqlite_unopenable(self._path, str(exc)) from exc
        if self._path != ":memory:":
            self._file = _file_identity(self._path)
        try:
            self._read_only = await self.worker.run(opened_read_only, self._sql["read_only"])
        except sqlite3.Error:  # another writer held the lock past busy_timeout: not known
            self._read_only = False

    async def close(self) -> None:
        await self.claims.close()
        await self.completions.close()
        await self.worker.close()

    def group_commits(self) -> tuple[GroupCommit[Any, Any], ...]:
        return self.claims, self.completions

    async def migrate(self) -> list[str]:
        return await self._write("write", migrate)

    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        request = ClaimRequest(intent, job_id, upstream, float(ttl), float(lease))
        with self.observed("claim"):
            return await self.claims.submit(request)

    async def _claim_batch(self, batch: list[ClaimRequest]) -> list[ClaimResult | BaseException]:
        return await self._transact(self._q.batch, self._q.claim, batch)

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
        request = ClaimRequest(intent, job_id, upstream, float(ttl), float(lease))
        return await self._write("claim_quota", self._q.claim_within, request, limits)

    async def get(self, owner: str, key: str) -> Job | None:
        return await self._read("get_job", self._q.job, "get_job", {"owner": owner, "key": key})

    async def watch_job(self, owner: str, key: str) -> Job | None:
        return await self.get(owner, key)  # every change is announced in-process anyway

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        with self.observed("complete"):
            won = await self.completions.submit(CompleteRequest(job, attempt, response, ttl))
        return self._notify_if(won, job)

    async def _complete_batch(self, batch: list[CompleteRequest]) -> list[bool | BaseException]:
        return await self._transact(self._q.batch, self._q.complete, batch)

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
        states = (job_state.value, attempt_state)
        failure = AttemptFailure(status, error)
        won = await self._write("settle", self._q.settle, job, attempt, states, failure)
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
        failure = AttemptFailure(status, error)
        await self._write("write", self._q.finish, job, attempt, attempt_end(state), failure)

    async def start_next_attempt(
        self, job: Job, upstream: str, *, lease: float, token: str | None = None
    ) -> Claimed | None:
        return await self._write(
            "write", self._q.next_attempt, "reopen_job", job, upstream, float(lease), token
        )

    async def fail_over(
        self,
        job: Job,
        attempt: int,
        upstream: str,
        *,
        failure: AttemptFailure,
        lease: float,
        token: str | None = None,
    ) -> Claimed | None:
        ended = (attempt_end(JobState.RELEASED), failure)
        return await self._write(
            "write", self._q.fail_over, job, attempt, upstream, ended, (float(lease), token)
        )

    async def add_attempt(self, job: Job, upstream: str, *, lease: float) -> int | None:
        started = await self._write(
            "write", self._q.next_attempt, "count_attempt", job, upstream, float(lease)
        )
        return None if started is None else started.attempt

    async def renew_lease(self, job: Job, *, lease: float) -> bool:
        return await self._write("write", self._q.renew_lease, job, float(lease))

    async def take_over(self, job: Job) -> bool:
        won = await self._write("write", self._q.take_over, job)
        return self._notify_if(won, job)

    async def forget(self, job: Job) -> bool:
        return await self._write("write", self._q.changed, "forget", cas(job))

    async def get_by_id(self, job_id: str) -> Job | None:
        return await self._read("read", self._q.job_with_attempts, job_id)

    async def late_response(self, job: Job, attempt: int) -> KeptResponse | None:
        params = {"owner": job.owner, "job_id": job.id, "number": attempt}
        row = await self._read("late_response", self._q.one, "get_late_response", params)
        return None if row is None else late_response_from_row(row)

    async def _resolve(
        self,
        job: Job,
        state: JobState,
        *,
        response: KeptResponse | None = None,
        ttl: float = 0.0,
        resolution: str = "operator",
    ) -> bool:
        params = cas(job) | {"resolution": resolution}
        if state is JobState.RELEASED:
            query = "resolve_released"
        elif state is JobState.COMPLETED and response is not None and not response.omitted:
            query = "resolve_completed"
            headers, body, key_id, _ = response_columns(response)
            params |= {
                "status": response.status,
                "headers": headers,
                "body": body,
                "key_id": key_id,
                "ttl": float(ttl),
            }
        else:
            raise ValueError("resolve as completed needs a response with a body")
        won = await self._write("write", self._q.changed, query, params)
        return self._notify_if(won, job)

    async def to_reseal(self, primary: str | None, after: Job | None, limit: int) -> list[Job]:
        params = {"primary": primary, "limit": limit, "owner": "", "id": ""}
        if after is not None:
            params |= {"owner": after.owner, "id": after.id}
        return await self._read("to_reseal", self._q.jobs, "responses_to_reseal", params)

    async def _reseal(self, job: Job, sealed: SealedResponse) -> bool:
        params = cas(job) | {
            "read_with": key_of(job.response),
            "box": sealed.sealed,
            "key_id": sealed.key_id,
        }
        return await self._write("reseal", self._q.changed, "reseal_response", params)

    async def late_to_reseal(
        self, primary: str | None, after: LateResponse | None, limit: int
    ) -> list[LateResponse]:
        params: Params = {"primary": primary, "limit": limit, "owner": "", "id": "", "number": 0}
        if after is not None:
            params |= {"owner": after.owner, "id": after.job_id, "number": after.number}
        rows = await self._read("late_to_reseal", self._q.rows, "late_responses_to_reseal", params)
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
        return await self._write("reseal", self._q.changed, "reseal_late_response", params)

    async def due_unknown(self, backoff: Backoff, *, after: str, limit: int) -> list[Job]:
        params = {
            "first": backoff.first,
            "longest": backoff.longest,
            "answer_within": backoff.answer_within,
            "after": after,
            "limit": limit,
        }
        return await self._read("read", self._q.jobs, "due_unknown", params)

    async def claim_check(self, job: Job, attempt: int, *, checks: int, due_after: float) -> bool:
        params = {"owner": job.owner, "job_id": job.id, "number": attempt, "checks": checks,
                  "version": job.version, "due_after": due_after}  # fmt: skip
        return await self._write("write", self._q.changed, "claim_check", params)

    async def record_evidence(self, job: Job, attempt: int, evidence: Evidence) -> None:
        params = {"owner": job.owner, "job_id": job.id, "number": attempt,
                  "entry": evidence_to_json(evidence), "keep": MAX_EVIDENCE_ENTRIES}  # fmt: skip
        await self._write("write", self._q.changed, "record_evidence", params)

    async def note_sent(self, job: Job, attempt: int, digest: str) -> None:
        params = {"owner": job.owner, "job_id": job.id, "number": attempt, "digest": digest}
        await self._write("write", self._q.changed, "note_sent", params)

    async def resend(
        self, job: Job, attempt: int, upstream: str, *, window: float, lease: float, token: str
    ) -> Claimed | None:
        fields = {"number": attempt, "window": float(window)}
        return await self._write(
            "write", self._q.resend, job, upstream, float(lease), token, fields
        )

    async def _delete(self, job: Job, *, force: bool = False) -> bool:
        params = cas(job) | {"force": force}
        won = await self._write("write", self._q.changed, "delete_job", params)
        return self._notify_if(won, job)

    async def stale_unknown(self, older_than: float, limit: int) -> list[Job]:
        params = {"age": float(older_than), "limit": limit}
        return await self._read("read", self._q.jobs, "stale_unknown", params)

    async def expired_leases(self, older_than: float, limit: int) -> list[Job]:
        params = {"grace": float(older_than), "limit": limit}
        return await self._read("expired_leases", self._q.jobs, "expired_leases", params)

    async def sweep_expired(self, batch_size: int) -> int:
        return await self._write("write", self._q.count, "sweep_expired", {"limit": batch_size})

    async def list_jobs(
        self, *, state: JobState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[Job]:
        params = {"state": state and state.value, "owner": owner, "limit": limit}
        return await self._read("read", self._q.jobs, "list_jobs", params)

    async def clock(self) -> datetime:
        row = await self._read("read", self._q.one, "clock", {})
        return datetime.fromtimestamp(float(row["now"]), UTC)

    async def owner_jobs(
        self, owner: str, *, after: str, before: datetime, limit: int
    ) -> list[Job]:
        params = {"owner": owner, "after": after, "before": before.timestamp(), "limit": limit}
        return await self._read("read", self._q.jobs, "owner_jobs", params)

    async def count_unknown(self) -> int:
        row = await self._read("read", self._q.one, "count_unknown", {})
        return int(row["unknown"])

    async def ping(self) -> bool:
        await self._read("read", ping)
        return not self._read_only and not on_read_only_mount(self._path)

    def _notify_if(self, won: bool, job: Job) -> bool:
        """Held duplicates in this process learn of the change after the commit."""
        if won:
            self.watch.notify(job.id)
        return won

    async def _read(
        self,
        what: str,
        fn: Callable[[sqlite3.Connection, Unpack[Args]], Result],
        *args: *Args,
    ) -> Result:
        """`fn` on the connection's thread, each of its statements its own transaction."""
        self._check_open()
        with self.observed(what), translate():
            return await self.worker.run(fn, *args)

    async def _write(
        self,
        what: str,
        fn: Callable[[sqlite3.Connection, Unpack[Args]], Result],
        *args: *Args,
    ) -> Result:
        with self.observed(what):
            return await self._transact(fn, *args)

    async def _transact(
        self, fn: Callable[[sqlite3.Connection, Unpack[Args]], Result], *args: *Args
    ) -> Result:
        """`fn` on the connection's thread in one transaction: one hop, one commit."""
        self._check_open()
        with translate():
            return await self.worker.transact(fn, *args)

    def _check_open(self) -> None:
        if not self.worker.is_open:
            raise StoreUnavailable("The store is not open.")
        if self._file is not None and not self._files_in_place():
            # The file, or its write-ahead log, was deleted or replaced under the open
            # connection: what is written now goes to a file no restart finds (the log's
            # commits not yet checkpointed with it), and every key would run again after one.
            if not self._gone_logged:
                log.error(
                    "the SQLite file %s or its -wal or -shm file was removed or replaced: restart",
                    self._path,
                )
                self._gone_logged = True
            raise StoreUnavailable("The SQLite file was removed or replaced while in use.")

    def _files_in_place(self) -> bool:
        """Whether the database file is the one opened, and its -wal and -shm files, once
        seen, are still the ones the connection uses (while it is open, SQLite never deletes
        them: only the last connection to close does)."""
        if _file_identity(self._path) != self._file:
            return False
        for index, suffix in enumerate(_COMPANIONS):
            found = _file_identity(self._path + suffix)
            seen = self._companions[index]
            if seen is None:
                self._companions[index] = found  # created with the first write after open
            elif found != seen:
                return False
        return True


def _one_group(_request: object) -> None:
    return None


_COMPANIONS = ("-wal", "-shm")


def _file_identity(path: str) -> tuple[int, int] | None:
    """The file at `path` (its device and inode), None when there is none."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _claim_key(request: ClaimRequest) -> tuple[str, str]:
    return request.intent.owner, request.intent.key
