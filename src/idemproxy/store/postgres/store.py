"""The PostgreSQL store (asyncpg): the source of truth for production and many replicas, with
the pooled connections it keeps between statements (`KeptConnections`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import operator
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg

from idemproxy.constants import DEFAULT_MAX_STORED_BODY, MAX_EVIDENCE_ENTRIES
from idemproxy.core.quota import QuotaLimits
from idemproxy.core.resolution import Backoff
from idemproxy.core.states import attempt_end, settle_states
from idemproxy.core.types import (
    Claimed,
    ClaimResult,
    Evidence,
    Existing,
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
    Outcome,
    claim_distinct,
    claim_group,
    complete_distinct,
    complete_group,
    complete_size,
)
from idemproxy.store.feed import stop_feed
from idemproxy.store.postgres.citus import (
    ClaimRow,
    change_then_add_attempt,
    citus_version,
    claim_distributed,
    distribute,
    read_or_insert_claim,
)
from idemproxy.store.postgres.errors import (
    DRIVER_ERRORS,
    translate_connect_errors,
    translate_errors,
    unavailable,
)
from idemproxy.store.postgres.listen import listen_forever
from idemproxy.store.postgres.quota import OneAtATime, OwnerTurns, claim_row_within, limit_reached
from idemproxy.store.postgres.renewals import RenewalConnections
from idemproxy.store.queries import load_migrations, load_queries, statements
from idemproxy.store.rows import (
    attempt_from_row,
    evidence_to_json,
    job_from_row,
    late_from_row,
    late_response_from_row,
    response_columns,
)

if TYPE_CHECKING:  # PoolConnectionProxy is generic only in asyncpg-stubs, not at runtime
    from asyncpg.pool import PoolConnectionProxy

    Pooled = PoolConnectionProxy[asyncpg.Record]


# Pooled PostgreSQL connections kept between statements and handed straight to waiters.
#
# asyncpg's release shields a new task, arms a timeout and runs the reset hook, and its acquire
# goes through its queue and holder, for every statement: about a tenth of the proxy's CPU per
# new key (bench/findings.md). A connection whose statement completed is clean (each statement
# commits on its own and the session carries no state: `postgres._keep_session`), so it is kept,
# last in first out, for the next statement, or handed to the longest-waiting caller when every
# connection is in use. Whatever may leave a connection in doubt (an error, a timeout, a
# cancellation) is released to the pool instead, which waits out the cancellation, terminates a
# broken connection and reconnects; its place goes to the next waiter.
#
# A connection kept idle for longer than `idle_lifetime` (asyncpg's
# `max_inactive_connection_lifetime`, 300 s by default) is released to the pool, whose own idle
# timer then closes it: after a burst, the connections it needed do not stay open for ever.
# asyncpg's recycling of a connection after `max_queries` statements does not apply to kept
# connections; a kept connection the server ended is noticed (`is_closed`) and released before
# reuse.


class KeptConnections:
    """The only way in and out of the pool: `take`, then `keep` or `release` (or `lend`).

    `capacity` is the pool's `max_size`. Once that many connections are out (in use or kept),
    a caller waits in this class's own first-in-first-out queue, bounded by `timeout`, instead
    of in asyncpg's acquire: a finished statement then hands its connection over directly, with
    no round trip through the pool (bench/findings.md, the handoff under load).
    """

    def __init__(
        self, pool: asyncpg.Pool, *, capacity: int, timeout: float, idle_lifetime: float = 300.0
    ) -> None:
        self._pool = pool
        self._capacity = capacity
        self._timeout = timeout
        self._idle_lifetime = idle_lifetime
        self._idle: list[tuple[Pooled, float]] = []  # and since when, oldest first
        self._sweep: asyncio.TimerHandle | None = None
        self._releasing: set[asyncio.Task[None]] = set()
        self._out = 0  # taken from the pool and not given back: in use, kept or being acquired
        self._waiters: collections.deque[asyncio.Future[Pooled | None]] = collections.deque()
        self._closing = False

    async def take(self) -> Pooled:
        deadline: float | None = None
        while True:
            while self._idle:
                conn, _ = self._idle.pop()
                # `_usable`, written out: every statement takes a kept connection.
                try:
                    closed = conn.is_closed()
                except asyncpg.InterfaceError:
                    closed = True
                if not closed:
                    return conn
                await self.release(conn)  # the pool frees its place and reconnects when needed
            if self._closing:
                raise StoreUnavailable("The store is closing.")
            if self._out < self._capacity:
                return await self._from_pool()
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self._timeout
            handed = await self._wait(deadline)
            if handed is not None:
                if _usable(handed):
                    return handed
                await self.release(handed)
            # Otherwise a place came free in the pool (or the connection was dead): go again.

    async def _from_pool(self) -> Pooled:
        self._out += 1
        try:
            return await self._acquire()
        except BaseException:
            self._out -= 1
            self._wake_one(None)
            raise

    def _acquire(self) -> Awaitable[Pooled]:
        """A pooled connection, within the command timeout when it may have to wait.

        asyncpg's `acquire(timeout=…)` arms a deadline for the acquire and then one for the
        release as well, even when an idle connection is there for the taking. So the deadline
        is only armed when the acquire may wait: for a release, or for a new connection.
        """
        if _live_connection_next(self._pool):
            return self._pool.acquire()
        return self._pool.acquire(timeout=self._timeout)

    async def _wait(self, deadline: float) -> Pooled | None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Pooled | None] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_at(deadline, _expire, waiter)
        try:
            return await waiter
        except BaseException:
            # Cancelled (or timed out) in the very instant something was handed over: pass it
            # on, or a connection or a free place would be lost to every later caller.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()
                if handed is None:
                    self._wake_one(None)
                elif not self.keep(handed):
                    await self.release(handed)
            raise
        finally:
            timer.cancel()
            if not waiter.done():
                self._waiters.remove(waiter)

    def _wake_one(self, handed: Pooled | None) -> bool:
        """Hand a connection, or None (a free place), to the longest waiter, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # cancelled or timed out ones are skipped
                waiter.set_result(handed)
                return True
        return False

    @contextlib.asynccontextmanager
    async def lend(self) -> AsyncIterator[Pooled]:
        """A connection for a block of statements, kept after it when the block completed
        (`PostgresStore._run` does the same inline, for its one statement)."""
        conn = await self.take()
        try:
            yield conn
        except BaseException:
            await self.release(conn)
            raise
        if not self.keep(conn):
            await self.release(conn)

    def keep(self, conn: Pooled) -> bool:
        """Keep a connection whose statement completed, or hand it to a waiter; False: release
        it to the pool."""
        if self._closing:
            return False
        if not (self._waiters and self._wake_one(conn)):  # nobody waits: no call to hand it on
            loop = asyncio.get_running_loop()
            self._idle.append((conn, loop.time()))
            if self._sweep is None:
                self._sweep = loop.call_later(self._idle_lifetime, self._release_stale)
        return True

    def _release_stale(self) -> None:
        """Release the connections kept idle for `idle_lifetime` (the oldest are first)."""
        loop = asyncio.get_running_loop()
        self._sweep = None
        cutoff = loop.time() - self._idle_lifetime
        stale = 0
        while stale < len(self._idle) and self._idle[stale][1] <= cutoff:
            stale += 1
        for conn, _ in self._idle[:stale]:
            task = loop.create_task(self._release_quietly(conn))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
        del self._idle[:stale]
        if self._idle:
            self._sweep = loop.call_at(self._idle[0][1] + self._idle_lifetime, self._release_stale)

    async def _release_quietly(self, conn: Pooled) -> None:
        with contextlib.suppress(*DRIVER_ERRORS):
            await self.release(conn)

    async def release(self, conn: Pooled) -> None:
        """Back to the pool, bounded: a statement cut off leaves a cancellation to wait for."""
        try:
            await self._pool.release(conn, timeout=self._timeout)
        finally:
            self._out -= 1
            self._wake_one(None)

    async def close(self) -> None:
        self._closing = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(StoreUnavailable("The store is closing."))
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await self._release_quietly(conn)
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        # The same error as asyncpg's acquire timeout: one of DRIVER_ERRORS (SPEC §11: 503).
        waiter.set_exception(TimeoutError("no pooled connection came free in time"))


def _usable(conn: Pooled) -> bool:
    """Whether a kept connection is still open. One the server ended is handed back to the pool
    by asyncpg itself when it notices, and its proxy then refuses every call."""
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


def _live_connection_next(pool: Any) -> bool:
    """Whether `pool.acquire()` returns at once: its queue's next holder has a live connection.

    asyncpg has no cheap public way to ask (`get_idle_size()` walks every holder, and costs
    twice what it would save), so this reads asyncpg 0.32's internals: `_queue` is a LifoQueue
    of idle holders, its `_queue` their list, and the last one, when live, is the next handed
    out. Should they change, the answer is False and every acquire is bounded, as before
    (tests/store/test_pg_calls.py notices). (A holder of an older generation would
    reconnect, but only `expire_connections()` makes one, and this store never calls it.)
    """
    try:
        return bool(pool._queue._queue[-1].is_connected())
    except (AttributeError, IndexError, TypeError):
        return False


T = TypeVar("T")
log = logging.getLogger(__name__)
# Several processes may start at once; one advisory lock serialises their migrations.
_MIGRATION_LOCK = 0x1DE3_9A0C
_CLAIM_RETRIES = 5
# Seconds a connection may stay idle before it is closed (asyncpg's default): kept ones are
# first released to the pool, whose own timer then closes them.
_IDLE_LIFETIME = 300.0
# The shortest timeout a batched row's statement gets, even when its caller's deadline has passed
# while it was queued: enough for a healthy store to answer.
_LEAST_TIMEOUT = 0.1
_NIL_UUID = uuid.UUID(int=0)  # before every job id: where a reseal starts


@dataclass(frozen=True, slots=True)
class Connections:
    """The store's connection pools: `minimum` to `maximum` for the statements, and `lease`
    reserved for lease renewals (store/postgres/renewals.py, SPEC §3.5); 0, for processes that
    run no attempts, renews on the main pool."""

    minimum: int = 2
    maximum: int = 20
    lease: int = 0


_DEFAULT_CONNECTIONS = Connections()


class PostgresStore(Store):
    def __init__(
        self,
        dsn: str,
        *,
        connections: Connections = _DEFAULT_CONNECTIONS,
        command_timeout: float = 5.0,
        listen: bool = True,
        late_bytes: int = DEFAULT_MAX_STORED_BODY,
        batch: int = DEFAULT_BATCH,
    ) -> None:
        super().__init__()
        self._late_bytes = late_bytes  # kept late bodies per job in all (SPEC §3.3)
        self._dsn = dsn
        # asyncpg refuses a min_size above max_size: `pool.store_connections: 1` is one connection.
        self._pool_size = (min(connections.minimum, connections.maximum), connections.maximum)
        self._command_timeout = command_timeout
        self._listen = listen
        self._sql = load_queries("postgres")
        self._pool: asyncpg.Pool | None = None
        self._kept: KeptConnections | None = None
        # SPEC §9: one owner's quota claims take turns before taking a connection.
        self._quota_turns = OwnerTurns(command_timeout)
        self._quota_reads = OneAtATime()  # an owner's usage read without its lock
        self._listener: asyncio.Task[None] | None = None
        # The Citus version when the database is a Citus coordinator (read at open): job
        # changes are then announced from the coordinator and the sweep takes its variant.
        self.citus: str | None = None
        self._renewals = (
            RenewalConnections(
                dsn, size=connections.lease, timeout=command_timeout, init=_init_connection
            )
            if connections.lease > 0
            else None
        )
        # Group commit (store/batching.py): one statement and one commit for concurrent calls.
        self.claims = GroupCommit[ClaimRequest, ClaimResult](
            "claim",
            self._claim_batch,
            group=claim_group,
            distinct=claim_distinct,
            limit=batch,
        )
        self.completions = GroupCommit[CompleteRequest, bool](
            "complete",
            self._complete_batch,
            group=complete_group,
            distinct=complete_distinct,
            limit=batch,
            size=complete_size,
        )
        self.claims.alone = self._claim_alone  # as `_claim_batch` sends a batch of one
        self.completions.alone = self._complete_alone

    async def open(self) -> None:
        async with translate_connect_errors(self._dsn):
            self._pool = await asyncpg.create_pool(
                self._dsn,
                min_size=self._pool_size[0],
                max_size=self._pool_size[1],
                command_timeout=self._command_timeout,
                max_inactive_connection_lifetime=_IDLE_LIFETIME,
                init=_init_connection,
                reset=_keep_session,
            )
            self._kept = KeptConnections(
                self._pool,
                capacity=self._pool_size[1],
                timeout=self._command_timeout,
                idle_lifetime=_IDLE_LIFETIME,
            )
            if self._renewals is not None:
                await self._renewals.open()
            async with self._pool.acquire() as conn:
                self.citus = await citus_version(conn, self._sql)
        if self._listen:
            self._listener = asyncio.create_task(
                listen_forever(self._dsn, self.watch, timeout=self._command_timeout),
                name="idemproxy-change-feed",
            )

    async def close(self) -> None:
        await self.claims.close()
        await self.completions.close()
        if self._listener is not None:
            await stop_feed(self._listener)
        if self._renewals is not None:
            await self._renewals.close()
        kept, self._kept = self._kept, None
        if kept is not None:
            await kept.close()  # the pool's close waits for every connection it lent
        if self._pool is not None:
            # A stalled server (frozen, or a network black hole) never answers the graceful
            # close, and asyncpg waits for it without limit: bound it, then abort the sockets
            # (asyncpg terminates the pool when its close is cancelled).
            try:
                await asyncio.wait_for(self._pool.close(), timeout=self._command_timeout)
            except TimeoutError:
                log.warning("store: the pool did not close in time; connections aborted")

    def group_commits(self) -> tuple[GroupCommit[Any, Any], ...]:
        return self.claims, self.completions

    async def migrate(self) -> list[str]:
        applied: list[str] = []
        async with self._connection("migrate") as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            await conn.execute(
                "CREATE SCHEMA IF NOT EXISTS idemproxy;"
                "CREATE TABLE IF NOT EXISTS idemproxy.schema_migrations ("
                " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            rows = await conn.fetch("SELECT version FROM idemproxy.schema_migrations")
            done = {row["version"] for row in rows}
            for version, sql in load_migrations("postgres"):
                if version not in done:
                    for statement in statements(sql):
                        await conn.execute(statement)
                    await conn.execute(
                        "INSERT INTO idemproxy.schema_migrations (version) VALUES ($1)", version
                    )
                    applied.append(version)
        return applied

    async def distribute(self) -> list[str]:
        """Distribute both tables by owner, co-located (Citus only; idempotent): the tables it
        distributed. Under the migration lock, so that it never races a migration."""
        async with self._connection("distribute") as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            return await distribute(conn, self._sql)

    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        request = ClaimRequest(intent, job_id, upstream, float(ttl), float(lease), time.monotonic())
        # Timed as a whole for the metrics (SPEC §13), batch and all; it failed if it raised
        # StoreUnavailable. In place, as in `complete`: every new key makes both.
        started, failed = time.perf_counter(), False
        try:
            return await self.claims.submit(request)
        except StoreUnavailable:
            failed = True
            raise
        finally:
            seconds = time.perf_counter() - started
            if self.claim_seconds is not None and not failed:
                self.claim_seconds(seconds)
            elif self.observer is not None:
                self.observer("claim", seconds, failed)

    async def _claim_batch(self, batch: list[ClaimRequest]) -> Sequence[Outcome[ClaimResult]]:
        """`claims`' statement: a lone claim alone, several in one `claim_batch`. On Citus each
        alone: it plans `INSERT … SELECT … FROM unnest` through the coordinator, not as a router
        query on the owner's shard (queries.sql, the distributed forms)."""
        if len(batch) == 1 or self.citus is not None:
            return await _each(self._claim_alone, batch)
        first = batch[0].intent
        columns = _claim_columns(batch)
        sql, timeout = self._sql["claim_batch"], self._batch_timeout(batch)
        try:
            rows = await self._run(
                "claim", lambda c: c.fetch(sql, first.owner, *columns, timeout=timeout), False
            )
        except StoreUnavailable:
            # One row's data was refused (SQLSTATE 22/23/54), or the statement failed or timed
            # out, maybe held up by one row (a lock another session holds): each alone, within
            # what is left of its caller's deadline, so that each gets what it would have had
            # alone. The statement may have committed before its answer was lost: a claim alone
            # then finds its own job (`_claim_result`).
            return _apart(self._claim_alone, batch)
        by_key = {row["key"]: row for row in rows}
        results: list[Outcome[ClaimResult]] = []
        for request in batch:
            row = by_key.get(request.intent.key)
            if row is None:  # a concurrent claim committed it while this one waited
                results.extend(await _each(self._claim_alone, [request]))
            else:
                results.append(_claim_result(row))
        return results

    async def _claim_alone(self, request: ClaimRequest) -> ClaimResult:
        intent = request.intent
        # `_time_left`, written out: one call less on every claim and completion.
        timeout = max(request.submitted + self._command_timeout - time.monotonic(), _LEAST_TIMEOUT)
        args = (
            intent.owner,
            intent.key,
            request.job_id,
            intent.fingerprint,
            intent.method,
            intent.path,
        )
        ttl, upstream, lease = request.ttl, request.upstream, request.lease
        job = (*args, ttl, lease)  # the distributed form's
        claim_sql = self._sql["claim"]
        for _ in range(_CLAIM_RETRIES):
            row: ClaimRow | None
            if self.citus is None:
                # `_fetchrow`, written out: one call less on every claim.
                fetch = operator.methodcaller(
                    "fetchrow", claim_sql, *args, ttl, upstream, lease, timeout=timeout
                )
                row = await self._run("claim", fetch, False)
            else:
                row = await self._run(
                    "claim", lambda c: claim_distributed(c, self._sql, job, upstream), False
                )
            if row is None:
                # A concurrent claim committed while this one waited: read it afresh.
                row = await self._fetchrow(
                    "get_job", intent.owner, intent.key, observe=False, timeout=timeout
                )
            if row is None:
                continue  # it was deleted in between (expiry); claim again
            return _claim_result(row, request.job_id)
        raise StoreUnavailable("The claim did not settle; retry.")

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
        args = (intent.owner, intent.key, job_id, intent.fingerprint, intent.method, intent.path)
        claim = self._claim_in_transaction(args, float(ttl), upstream, float(lease))
        owner_key = (intent.owner, intent.key)
        if self._quota_turns.busy(intent.owner):
            # SPEC §9: a refused flood is answered without the lock, one read of the owner's
            # usage at a time (a read each would take the pool from every other owner).
            async with self._quota_reads.slot(intent.owner):
                limit = None
                if self._quota_turns.busy(intent.owner):
                    limit = await self._run(
                        "quota_usage", lambda c: limit_reached(c, self._sql, owner_key, limits)
                    )
            if limit is not None:
                return limit
        async with self._quota_turns.turn(intent.owner):
            row = await self._run(
                "claim_quota", lambda c: claim_row_within(c, self._sql, owner_key, limits, claim)
            )
        if isinstance(row, str):
            return row
        if row is None:  # a concurrent claim of the key committed first: a duplicate
            return await self.claim(intent, job_id, upstream, ttl=ttl, lease=lease)
        return _claim_result(row)

    def _claim_in_transaction(
        self, args: tuple[str, ...], ttl: float, upstream: str, lease: float
    ) -> Callable[[Pooled], Awaitable[ClaimRow | None]]:
        """The claim as the quota transaction runs it: `claim`, or on Citus its router form
        (the job read, then inserted with its first attempt; store/postgres/citus.py)."""
        if self.citus is None:
            sql = self._sql["claim"]
            return lambda c: c.fetchrow(sql, *args, ttl, upstream, lease)
        job = (*args, ttl, lease)
        return lambda c: read_or_insert_claim(c, self._sql, job, upstream)

    async def get(self, owner: str, key: str) -> Job | None:
        row = await self._fetchrow("get_job", owner, key)
        return None if row is None else job_from_row(row)

    async def watch_job(self, owner: str, key: str) -> Job | None:
        row = await self._fetchrow("watch_job", owner, key)
        return job_from_row(row) if row is not None else await self.get(owner, key)

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        request = CompleteRequest(job, attempt, response, ttl, time.monotonic())
        started, failed = time.perf_counter(), False  # timed as `claim` is
        try:
            return await self.completions.submit(request)
        except StoreUnavailable:
            failed = True
            raise
        finally:
            seconds = time.perf_counter() - started
            if self.complete_seconds is not None and not failed:
                self.complete_seconds(seconds)
            elif self.observer is not None:
                self.observer("complete", seconds, failed)

    async def _complete_batch(self, batch: list[CompleteRequest]) -> Sequence[Outcome[bool]]:
        """`completions`' statement: a lone one alone; several as one pipeline of `complete`,
        one run per completion, sent at once and committed together (asyncpg's `fetchmany`:
        one round trip, one transaction, one commit). Each run is the single-row statement
        whose cached plan looks its job and attempt up by key, whatever the tables' size and
        statistics (tests/store/test_pg_point_lookups.py), which one statement over arrays
        joined to the tables could not promise: a plan made while they were small read them
        whole once they had grown. In job id order, so that the jobs are locked in the same
        order by every batch and cannot deadlock. On Citus each alone, as in `_claim_batch`."""
        if len(batch) == 1 or self.citus is not None:
            return await _each(self._complete_alone, batch)
        runs = [self._complete_arguments(request) for request in batch]
        runs.sort(key=operator.itemgetter(1))
        sql, timeout = self._sql["complete"], self._batch_timeout(batch)
        try:
            rows = await self._run(
                "complete", lambda c: c.fetchmany(sql, runs, timeout=timeout), False
            )
        except StoreUnavailable:
            # As in _claim_batch. A completion whose batch committed before its answer was lost
            # loses its compare-and-swap alone (the job is completed already): its caller
            # re-reads the job and answers with the response it holds, its own.
            return _apart(self._complete_alone, batch)
        won = {str(row["id"]) for row in rows}
        return [request.job.id in won for request in batch]

    def _complete_arguments(self, request: CompleteRequest) -> tuple[Any, ...]:
        """`complete`'s arguments for one completion."""
        job, response = request.job, request.response
        headers, body, key_id, omitted = response_columns(response)
        return (
            job.owner,
            job.id,
            job.version,
            request.attempt,
            response.status,
            headers,
            body,
            omitted,
            float(request.ttl),
            self._late_bytes,
            key_id,
            job.key,
        )

    async def _complete_alone(self, request: CompleteRequest) -> bool:
        job, response = request.job, request.response
        headers, body, key_id, omitted = response_columns(response)
        # $1-$9 of both statements (queries.sql `complete`, `complete_sole`).
        owner, status, ttl = job.owner, response.status, float(request.ttl)
        shared = (owner, job.id, job.version, request.attempt, status, headers, body, omitted, ttl)
        row = None
        if job.attempt_count == 1:
            # A job of one attempt that wins (every new key's) needs none of what `complete`
            # does for a loser or for the job's other attempts (queries.sql `complete_sole`).
            # `_complete_row`, written out: one call less on every new key.
            timeout = max(
                request.submitted + self._command_timeout - time.monotonic(), _LEAST_TIMEOUT
            )
            sole = self._sql["complete_sole"]
            fetch = operator.methodcaller(
                "fetchrow", sole, *shared, key_id, job.key, timeout=timeout
            )
            row = await self._run("complete", fetch, False)
        if row is None:
            args = self._complete_arguments(request)
            row = await self._complete_row("complete", args, request.submitted)
        if self.citus is None:
            return row is not None
        return await self._announced(job, row, watched_only=True)

    async def _complete_row(
        self, name: str, args: tuple[Any, ...], submitted: float
    ) -> asyncpg.Record | None:
        """A completion's statement, within what is left of its caller's deadline, timed as
        `complete` (by its caller, `complete`)."""
        # `_time_left`, written out: one call less on every completion.
        timeout = max(submitted + self._command_timeout - time.monotonic(), _LEAST_TIMEOUT)
        fetch = operator.methodcaller("fetchrow", self._sql[name], *args, timeout=timeout)
        row: asyncpg.Record | None = await self._run("complete", fetch, False)
        return row

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
        row = await self._fetchrow(
            "settle",
            *_cas(job),
            attempt,
            job_state.value,
            attempt_state.value,
            status,
            error,
            job.key,
        )
        return await self._announced(job, row, watched_only=True)

    async def finish_attempt(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> None:
        ended = attempt_end(state).value
        await self._execute("finish_attempt", job.owner, job.id, attempt, ended, status, error)

    async def start_next_attempt(
        self, job: Job, upstream: str, *, lease: float, token: str | None = None
    ) -> Claimed | None:
        if self.citus is None:
            row = await self._fetchrow(
                "start_next_attempt", *_cas(job), upstream, float(lease), token
            )
        else:
            change = ("start_next_attempt_distributed", (*_cas(job), float(lease), token))
            row = await self._run(
                "start_next_attempt",
                lambda c: change_then_add_attempt(c, self._sql, change, upstream),
            )
        return _claimed(row)

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
        status, error = failure
        if self.citus is None:
            row = await self._fetchrow(
                "fail_over", *_cas(job), attempt, status, error, upstream, float(lease), token
            )
        else:
            change = ("fail_over_distributed", (*_cas(job), float(lease), token))
            failed = (job.owner, job.id, attempt, "failed", status, error)
            row = await self._run(
                "fail_over",
                lambda c: change_then_add_attempt(c, self._sql, change, upstream, failed),
            )
        return _claimed(row)

    async def add_attempt(self, job: Job, upstream: str, *, lease: float) -> int | None:
        if self.citus is None:
            row = await self._fetchrow("add_attempt", *_cas(job), upstream, float(lease))
            return None if row is None else int(row["number"])
        change = ("add_attempt_distributed", (*_cas(job), float(lease)))
        row = await self._run(
            "add_attempt", lambda c: change_then_add_attempt(c, self._sql, change, upstream)
        )
        return None if row is None else int(row["attempt_count"])

    async def renew_lease(self, job: Job, *, lease: float) -> bool:
        sql, args = self._sql["renew_lease"], (*_cas(job), float(lease), job.key)
        renewals = self._renewals
        if renewals is None:
            return bool(await self._run("renew_lease", lambda c: c.fetch(sql, *args)))
        # SPEC §3.5: never queued behind request traffic for a pooled connection.
        with self.observed("renew_lease"):
            async with translate_errors("renew_lease"):
                return bool(await renewals.fetch(sql, *args))

    async def take_over(self, job: Job) -> bool:
        return await self._announced(job, await self._fetchrow("take_over", *_cas(job)))

    async def forget(self, job: Job) -> bool:
        return await self._execute("forget", *_cas(job)) == "DELETE 1"

    async def get_by_id(self, job_id: str) -> Job | None:
        try:
            job_uuid = uuid.UUID(job_id)
        except ValueError:
            return None  # ids are UUIDs here: anything else names no job, as in SQLite
        async with self._connection("get_by_id") as conn:
            row = await conn.fetchrow(self._sql["get_job_by_id"], job_uuid)
            if row is None:
                return None
            attempts = await conn.fetch(self._sql["get_attempts"], row["owner"], job_uuid)
        return job_from_row(row, tuple(attempt_from_row(a) for a in attempts))

    async def late_response(self, job: Job, attempt: int) -> KeptResponse | None:
        row = await self._fetchrow("get_late_response", job.owner, uuid.UUID(job.id), attempt)
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
        if state is JobState.RELEASED:
            row = await self._fetchrow("resolve_released", *_cas(job), resolution)
            return await self._announced(job, row)
        if state is not JobState.COMPLETED or response is None or response.omitted:
            raise ValueError("resolve as completed needs a response with a body")
        headers, body, key_id, _ = response_columns(response)
        row = await self._fetchrow(
            "resolve_completed",
            *_cas(job),
            resolution,
            response.status,
            headers,
            body,
            float(ttl),
            key_id,
        )
        return await self._announced(job, row)

    async def to_reseal(self, primary: str | None, after: Job | None, limit: int) -> list[Job]:
        start = ("", _NIL_UUID) if after is None else (after.owner, uuid.UUID(after.id))
        rows = await self._run(
            "to_reseal",
            lambda c: c.fetch(self._sql["responses_to_reseal"], primary, *start, limit),
        )
        return [job_from_row(row) for row in rows]

    async def _reseal(self, job: Job, sealed: SealedResponse) -> bool:
        read_with = key_of(job.response)
        row = await self._fetchrow(
            "reseal_response", *_cas(job), read_with, sealed.sealed, sealed.key_id
        )
        return await self._announced(job, row)  # the replay caches drop the old box

    async def late_to_reseal(
        self, primary: str | None, after: LateResponse | None, limit: int
    ) -> list[LateResponse]:
        start = (
            ("", _NIL_UUID, 0)
            if after is None
            else (after.owner, uuid.UUID(after.job_id), after.number)
        )
        rows = await self._run(
            "late_to_reseal",
            lambda c: c.fetch(self._sql["late_responses_to_reseal"], primary, *start, limit),
        )
        return [late_from_row(row) for row in rows]

    async def reseal_late(self, late: LateResponse, sealed: SealedResponse) -> bool:
        status = await self._execute(
            "reseal_late_response",
            late.owner,
            uuid.UUID(late.job_id),
            late.number,
            key_of(late.response),
            sealed.sealed,
            sealed.key_id,
        )
        return status == "UPDATE 1"

    async def due_unknown(self, backoff: Backoff, *, after: str, limit: int) -> list[Job]:
        args = (backoff.first, backoff.longest, backoff.answer_within, after, limit)
        rows = await self._run("due_unknown", lambda c: c.fetch(self._sql["due_unknown"], *args))
        return [job_from_row(row) for row in rows]

    async def claim_check(self, job: Job, attempt: int, *, checks: int, due_after: float) -> bool:
        args = (job.owner, job.id, attempt, job.version, checks, due_after)
        return await self._fetchrow("claim_check", *args) is not None

    async def record_evidence(self, job: Job, attempt: int, evidence: Evidence) -> None:
        entry = evidence_to_json(evidence)
        args = (job.owner, job.id, attempt, entry, MAX_EVIDENCE_ENTRIES)
        await self._execute("record_evidence", *args)

    async def note_sent(self, job: Job, attempt: int, digest: str) -> None:
        await self._execute("note_sent", job.owner, job.id, attempt, digest)

    async def resend(
        self, job: Job, attempt: int, upstream: str, *, window: float, lease: float, token: str
    ) -> Claimed | None:
        change = ("resend_job", (*_cas(job), float(lease), token, attempt, float(window)))
        row = await self._run(
            "resend", lambda c: change_then_add_attempt(c, self._sql, change, upstream)
        )
        return _claimed(row)

    async def _delete(self, job: Job, *, force: bool = False) -> bool:
        return await self._announced(job, await self._fetchrow("delete_job", *_cas(job), force))

    async def stale_unknown(self, older_than: float, limit: int) -> list[Job]:
        rows = await self._run(
            "stale_unknown", lambda c: c.fetch(self._sql["stale_unknown"], older_than, limit)
        )
        return [job_from_row(row) for row in rows]

    async def expired_leases(self, older_than: float, limit: int) -> list[Job]:
        rows = await self._run(
            "expired_leases",
            lambda c: c.fetch(self._sql["expired_leases"], float(older_than), limit),
        )
        return [job_from_row(row) for row in rows]

    async def sweep_expired(self, batch_size: int) -> int:
        name = "sweep_expired" if self.citus is None else "sweep_expired_distributed"
        status = await self._run("sweep_expired", lambda c: c.execute(self._sql[name], batch_size))
        return int(status.rsplit(" ", 1)[-1])

    async def list_jobs(
        self, *, state: JobState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[Job]:
        rows = await self._run(
            "list_jobs",
            lambda c: c.fetch(self._sql["list_jobs"], state and state.value, owner, limit),
        )
        return [job_from_row(row) for row in rows]

    async def clock(self) -> datetime:
        row = await self._fetchrow("clock")
        assert row is not None, "clock always returns one row"
        now: datetime = row["now"]
        return now

    async def owner_jobs(
        self, owner: str, *, after: str, before: datetime, limit: int
    ) -> list[Job]:
        rows = await self._run(
            "owner_jobs",
            lambda c: c.fetch(self._sql["owner_jobs"], owner, after, before, limit),
        )
        return [job_from_row(row) for row in rows]

    async def count_unknown(self) -> int:
        row = await self._fetchrow("count_unknown")
        return 0 if row is None else int(row["unknown"])

    async def ping(self) -> bool:
        row = await self._fetchrow("ping")
        return row is not None and bool(row["writable"])

    async def _announced(
        self, job: Job, row: asyncpg.Record | None, *, watched_only: bool = False
    ) -> bool:
        """Whether the statement changed the job (`row`); on Citus, the change is then announced
        from the coordinator, where the proxies LISTEN (queries.sql `notify`). After the commit,
        not in it: a proxy that dies in between leaves waiters to their periodic re-read
        (WAITER_RECHECK_SECONDS), and a replay cache to its entry's TTL (docs/deploy.md)."""
        if row is None:
            return False
        if self.citus is not None and (not watched_only or row["watched"]):
            # The change is committed: its caller must hear so even if the announcement fails
            # (which `_run` logs).
            with contextlib.suppress(StoreUnavailable):
                await self._execute("notify", job.id)
        return True

    async def _fetchrow(
        self, name: str, *args: Any, observe: bool = True, timeout: float | None = None
    ) -> asyncpg.Record | None:
        """`timeout`: the statement's own (seconds), else `pool.store_timeout`."""
        # `conn.fetchrow(sql, *args, timeout=…)` by a C-level caller: no frame of its own.
        fetch = operator.methodcaller("fetchrow", self._sql[name], *args, timeout=timeout)
        row: asyncpg.Record | None = await self._run(name, fetch, observe)
        return row

    def _time_left(self, submitted: float) -> float:
        """What is left of a request's deadline, `pool.store_timeout` after its caller asked
        (a batched one's own statement retried alone gets no more than that)."""
        left = submitted + self._command_timeout - time.monotonic()
        return max(left, _LEAST_TIMEOUT)

    def _batch_timeout(self, batch: list[ClaimRequest] | list[CompleteRequest]) -> float:
        """Half of what is left to its most urgent row: a batch held up (by a lock on one of
        its rows, a slow server) leaves its rows the other half to be retried alone."""
        return max(min(self._time_left(r.submitted) for r in batch) / 2, _LEAST_TIMEOUT)

    async def _execute(self, name: str, *args: Any) -> str:
        return await self._run(name, lambda c: c.execute(self._sql[name], *args))

    async def _run(
        self,
        what: str,
        call: Callable[[Pooled], Awaitable[T]],
        observe: bool = True,
        *,
        retry: bool = True,
    ) -> T:
        """One statement on a pooled connection: timed for the metrics (SPEC §13), its driver
        errors translated (SPEC §11). What `_connection` and `KeptConnections.lend` do, flattened
        into one frame: the hot path makes two or three of these per request. `observe=False`:
        a statement of a batch, timed by its callers (`claim`, `complete`)."""
        kept = self._kept
        if kept is None:
            raise StoreUnavailable("The store is not open.")
        started = time.perf_counter()
        failed = False
        try:
            conn = await kept.take()
            try:
                result = await call(conn)
            except BaseException as exc:
                if isinstance(exc, _CONNECTION_LOST):
                    # Not handed out again: the pool opens another in its place.
                    with contextlib.suppress(asyncpg.InterfaceError):
                        conn.terminate()
                await kept.release(conn)
                raise
            if not kept.keep(conn):
                await kept.release(conn)
            return result
        except DRIVER_ERRORS as exc:
            # A pooled session the server had just ended, handed out before asyncpg noticed:
            # asyncpg refuses the statement before sending it, so one retry on a fresh
            # connection cannot run anything twice (and every write here is a CAS anyway). A
            # read that lost its connection on the way (a server that ended the session as it
            # was sent: a restart, a pooler, an operator's pg_terminate_backend) changed
            # nothing either: asked again, rather than a held duplicate's 503 on a healthy
            # store. Neither is an error of the store's until the second try fails too.
            if not retry or not (
                isinstance(exc, asyncpg.InternalClientError)
                or (what in _READS and isinstance(exc, _CONNECTION_LOST))
            ):
                failed = True
                raise unavailable(what, exc) from exc
            log.debug("store: %s lost its connection (%s); asked again", what, exc)
        finally:
            if observe and self.observer is not None:
                self.observer(what, time.perf_counter() - started, failed)
        return await self._run(what, call, observe, retry=False)

    @contextlib.asynccontextmanager
    async def _connection(self, what: str) -> AsyncIterator[Pooled]:
        """A pooled connection for several statements (migrations, operators' reads)."""
        kept = self._kept
        if kept is None:
            raise StoreUnavailable("The store is not open.")
        with self.observed(what):
            async with translate_errors(what), kept.lend() as conn:
                yield conn


# Statements that read and change nothing, safe to send again on another connection.
_READS = frozenset({"get_job", "get_late_response", "count_unknown", "ping"})
_CONNECTION_LOST = (
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.AdminShutdownError,
    ConnectionResetError,
    ConnectionAbortedError,
)


def _cas(job: Job) -> tuple[str, str, int]:
    """(owner, id, version): every hot-path statement names the owner (SPEC §11)."""
    return job.owner, job.id, job.version


R = TypeVar("R")
Q = TypeVar("Q")


async def _each(alone: Callable[[Q], Awaitable[R]], batch: list[Q]) -> list[R | BaseException]:
    """Each request of `batch` in its own statement, concurrently: each caller's own result or
    error, as it would have had without the batch."""
    if len(batch) == 1:
        try:
            return [await alone(batch[0])]
        except Exception as exc:
            return [exc]
    return await asyncio.gather(*(alone(request) for request in batch), return_exceptions=True)


def _apart(alone: Callable[[Q], Awaitable[R]], batch: list[Q]) -> list[Outcome[R]]:
    """Each request of `batch` in its own statement, concurrently, each answered as soon as its
    own ends (store/batching.py): the result or error each would have had alone."""
    return [asyncio.ensure_future(alone(request)) for request in batch]


def _claim_result(row: ClaimRow, job_id: str | None = None) -> ClaimResult:
    """`job_id`: the claim's own. A job of that id is this very claim's, committed by its batch's
    statement whose answer was lost (a timeout): claimed, never a job to hold on (it would
    hold on itself until its lease ran out)."""
    job = job_from_row(row)
    if row.get("created", False) or (job_id is not None and _same_id(job.id, job_id)):
        return Claimed(job, 1)
    return Existing(job)


def _same_id(stored: str, job_id: str) -> bool:
    try:
        return uuid.UUID(stored) == uuid.UUID(job_id)
    except ValueError:
        return False


def _claim_columns(batch: list[ClaimRequest]) -> tuple[list[Any], ...]:
    """`claim_batch`'s arrays $2..$9, one element per claim."""
    return (
        [r.intent.key for r in batch],
        [r.job_id for r in batch],
        [r.intent.fingerprint for r in batch],
        [r.intent.method for r in batch],
        [r.intent.path for r in batch],
        [r.ttl for r in batch],
        [r.upstream for r in batch],
        [r.lease for r in batch],
    )


def _claimed(row: asyncpg.Record | None) -> Claimed | None:
    if row is None:
        return None
    started = job_from_row(row)
    return Claimed(started, started.attempt_count)


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """No session reset on release: the store never leaves session state on a pooled
    connection (LISTEN has its own connection, the migration lock is transaction-scoped), and
    asyncpg still rolls back any open transaction. Saves a round trip per store call."""


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=str, decoder=str, schema="pg_catalog")
    # SPEC §2.2: the claim is durable before a byte goes upstream. With synchronous_commit=off
    # (a common throughput setting for a database or role) PostgreSQL acknowledges a commit
    # before its WAL is flushed: a crash loses the claim and a retry executes a second time
    # (tests/faults/test_db_faults.py). Raised to `on` for this session only when it is off;
    # kept because the pool runs no session reset (_keep_session).
    await conn.execute(
        "SELECT set_config('synchronous_commit', 'on', false)"
        " WHERE current_setting('synchronous_commit') = 'off'"
    )
