"""An in-process replay cache of completed jobs in front of the PostgreSQL store (SPEC §11),
and what every replay cache does in front of the store (`ReplayCache`, also Redis's).

Without it every duplicate costs a round trip and a read on PostgreSQL: about a third of a
replay's CPU across all processes (bench/findings.md). A completed job never changes again
(SPEC §3.2: `completed` is terminal); it only disappears, when it expires or an operator deletes
it. So a proxy may answer a duplicate from memory exactly as from a read, provided that it never
outlives the job:

* **Expiry.** An entry lives at most `ttl` seconds and never past its job's expiry: from the
  proxy's own completion, measured from before the store call (the database's `now() + ttl`
  comes later); for a job read from the store, by the database's clock as the change feed
  measures it against this host's (`JobWatch.clock_offset`), less `CLOCK_MARGIN_SECONDS`.
* **Deletion.** Every deletion is announced on the store's change feed (`pg_notify` in the same
  statement, queries.sql `delete_job`), which drops the entry by job id in every replica and
  worker. The cache serves and fills only while that feed is live (`JobWatch.live`); when the
  feed is lost it is emptied and stays off until LISTEN is back, so no deletion passes unseen.
  A read that was under way while its job's change was announced is not kept (it may predate
  the change): every announcement gets a sequence number, and a read keeps its result only if
  no announcement for that job, and no "anything may have changed", came after it began.
* **Tenants.** Entries are keyed by (owner, key), as the store is; the decision core checks the
  fingerprint of a cached job as of a stored one (409 on another payload).

Bounded by bytes (bodies plus an allowance per entry), least recently used out first. What it
cannot see: a row deleted by hand in SQL, without `pg_notify` (docs/operations.md), and a
`LISTEN` that is accepted but never delivers (a transaction-pooling PgBouncer).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from datetime import UTC, datetime
from itertools import chain
from typing import NamedTuple

from idemproxy.constants import CLOCK_MARGIN_SECONDS
from idemproxy.core.types import (
    ClaimResult,
    Existing,
    Intent,
    Job,
    JobState,
    KeptResponse,
    SealedResponse,
)
from idemproxy.store.base import Store
from idemproxy.store.hooks import Change
from idemproxy.store.layers import JobLayer

# What both replay caches (this one and store/redis/cache.py) need besides their
# entries: to keep the job a winning completion wrote without reading it back, the attempts this
# process added to jobs in flight (hedging), which the job snapshot the runner holds does not
# count; and how long an entry may live.


# A cache entry that would live less than this (seconds) is not worth writing.
MIN_ENTRY_SECONDS = 0.5
# Hedged versions tracked at most: a version whose attempts never end here (the process's tasks
# cancelled) must not grow the map for ever. Forgetting one costs only a cached job's attempt
# count, which no replay shows; the stored job keeps the true one.
MAX_HEDGED_VERSIONS = 10_000


class ReplayCache(JobLayer):
    def __init__(self, inner: Store | JobLayer) -> None:
        super().__init__(inner)
        # (job id, version) -> the highest attempt number `add_attempt` started under that
        # version (SPEC §3.4: hedges keep the version), until an attempt of that version
        # completes or settles, won or lost: either way no later completion of that version can
        # win. Keyed by version because a late attempt of an older version ending (its CAS
        # lost) must not forget the hedges of the version in flight now.
        self._hedged: dict[tuple[str, int], int] = {}

    async def add_attempt(self, job: Job, upstream: str, *, lease: float) -> int | None:
        number = await self.inner.add_attempt(job, upstream, lease=lease)
        if number is not None:
            hedged = (job.id, job.version)
            self._hedged[hedged] = max(number, self._hedged.get(hedged, 0))
            if len(self._hedged) > MAX_HEDGED_VERSIONS:
                del self._hedged[next(iter(self._hedged))]  # the oldest
        return number

    async def settle(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> bool:
        self._hedged.pop((job.id, job.version), None)
        return await self.inner.settle(job, attempt, state, status=status, error=error)

    async def complete_in_store(
        self, job: Job, attempt: int, response: KeptResponse, *, ttl: float
    ) -> tuple[Job, float] | None:
        """The inner store's completion; when it won, the job as it wrote it (queries.sql
        `complete`) and the seconds it may be kept (measured from before the store call, whose
        `now() + ttl` comes later: an entry never outlives its job). A completion lost or failed
        keeps nothing of the job."""
        started, now = time.monotonic(), time.time()
        won = False
        try:
            won = await self.inner.complete(job, attempt, response, ttl=ttl)
        finally:
            hedged = self._hedged.pop((job.id, job.version), 0) if self._hedged else 0
        if not won:
            return None
        # Positional, not `job._replace(...)`: a third of the time, on every new key.
        (job_id, owner, key, fingerprint, _, version, count, method, path) = job[:9]
        done = Job(
            job_id,
            owner,
            key,
            fingerprint,
            JobState.COMPLETED,
            version + 1,
            max(count, hedged),
            method,
            path,
            attempt,
            response,
            job.created_at,
            job.updated_at,
            datetime.fromtimestamp(now + ttl, tz=UTC),
            False,
            False,
            job.resolution,
            job.attempts,
        )
        return done, ttl - (time.monotonic() - started)


def body_bytes(response: KeptResponse) -> int:
    """The bytes of a response's body as a cache bounds it: the whole box when it is sealed
    (its body cannot be told from its headers without opening it)."""
    if isinstance(response, SealedResponse):
        return len(response.sealed)
    return len(response.body or b"")


def seconds_left(job: Job, clock_offset: float = 0.0) -> float:
    """The job's remaining lifetime by the database's clock (which decides expiry, SPEC §3.5):
    this process's clock plus `clock_offset` (JobWatch.clock_offset), less a margin for the
    offset's error and drift between measurements. How long a cache may keep it."""
    if job.expires_at is None:
        return 0.0
    now = time.time() + clock_offset
    return job.expires_at.timestamp() - now - CLOCK_MARGIN_SECONDS


log = logging.getLogger(__name__)
# Bytes counted for an entry besides its body and headers' text: the entry, job, Existing and
# datetime objects and dictionary slots (about 560 bytes with tracemalloc), and the job's strings
# and the response's objects, which the cache keeps alive (about 600 more).
ENTRY_OVERHEAD_BYTES = 1200
# Job ids whose latest announcement is remembered (for reads under way); older ones only move
# the floor below which every read under way is refused.
_TRACKED_CHANGES = 1024


class _Entry(NamedTuple):
    found: Existing  # what a claim returns, built once (a frozen dataclass costs to build)
    deadline: float  # time.monotonic()
    size: int


class MemoryReplayCache(ReplayCache):
    def __init__(
        self, inner: Store | JobLayer, *, max_bytes: int, max_body: int, ttl: float
    ) -> None:
        super().__init__(inner)
        self._max_bytes = max_bytes
        self._max_body = max_body
        self._ttl = ttl
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._scope_of: dict[str, tuple[str, str]] = {}  # job id -> (owner, key)
        self._bytes = 0
        # Announcements: a sequence number each, the latest per job id, and a floor.
        self._sequence = 0
        self._changed: OrderedDict[str, int] = OrderedDict()
        self._floor = 0
        self.hits = 0
        self.watch.on_change(self._on_change)
        self.record.hooks.append(self)

    async def open(self) -> None:
        log.info(
            "in-process replay cache: up to %d bytes, bodies up to %d bytes, %g s per entry",
            self._max_bytes,
            self._max_body,
            self._ttl,
        )

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        """Bytes held, as counted against `max_bytes`."""
        return self._bytes

    # --- the hot path -------------------------------------------------------------------------

    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        scope = (intent.owner, intent.key)
        entry = self._entries.get(scope)
        if entry is not None:
            if self.watch.live and entry.deadline > time.monotonic():
                self._entries.move_to_end(scope)
                self.hits += 1
                return entry.found
            self._drop(scope)
        mark = self._sequence
        result = await self.inner.claim(intent, job_id, upstream, ttl=ttl, lease=lease)
        if isinstance(result, Existing):
            self._remember(result.job, seconds_left(result.job, self.watch.clock_offset), mark)
        return result

    async def lookup(self, owner: str, key: str) -> Job | None:
        scope = (owner, key)
        entry = self._entries.get(scope)
        if entry is not None and self.watch.live and entry.deadline > time.monotonic():
            self._entries.move_to_end(scope)
            self.hits += 1
            return entry.found.job
        mark = self._sequence
        job = await self.inner.lookup(owner, key)
        if job is not None:
            self._remember(job, seconds_left(job, self.watch.clock_offset), mark)
        return job

    async def get(self, owner: str, key: str) -> Job | None:
        mark = self._sequence
        job = await self.inner.get(owner, key)
        if job is not None:
            self._remember(job, seconds_left(job, self.watch.clock_offset), mark)
        return job

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        mark = self._sequence
        completed = await self.complete_in_store(job, attempt, response, ttl=ttl)
        if completed is None:
            return False
        self._remember(*completed, mark)
        return True

    async def forget(self, job: Job) -> bool:
        self._drop_job(job.id)
        return await self.inner.forget(job)

    # --- changes made past the hot path (store.hooks.ChangeHook) ---------------------------------

    async def deleting(self, job: Job) -> None:
        # Announced locally before and after: a read under way keeps nothing, and the feed's
        # own announcement reaches the other replicas.
        self._on_change(job.id)

    def changed(self, job: Job, change: Change, won: bool) -> None:
        if change is Change.DELETED or change is Change.UNREADABLE:
            self._on_change(job.id)

    # --- the cache ------------------------------------------------------------------------------

    def _remember(self, job: Job, lifetime: float, mark: int) -> None:
        """Keep a completed job for at most `ttl` and `lifetime` seconds, unless a change of it
        may have been announced after the read that returned it began (`mark`). Its tests in
        place, not in helpers: every new key's completion and every read of a job come here."""
        response = job.response
        if (
            not self.watch.live
            or job.state is not JobState.COMPLETED
            or job.expired
            or response is None
            or mark < self._floor  # changed since the read began: `_on_change`
            or self._changed.get(job.id, 0) > mark
        ):
            return
        # The body as `body_bytes` bounds it, and the bytes the entry holds.
        if isinstance(response, SealedResponse):
            body = stored = len(response.sealed)  # headers and body, sealed (SPEC §11)
        else:
            body = len(response.body or b"")
            stored = body + sum(map(len, chain.from_iterable(response.headers)))
        if body > self._max_body:
            return
        size = ENTRY_OVERHEAD_BYTES + stored + len(job.key)
        lifetime = min(self._ttl, lifetime)
        if lifetime < MIN_ENTRY_SECONDS or size > self._max_bytes:
            return
        scope = (job.owner, job.key)
        if scope in self._entries:
            self._drop(scope)
        self._entries[scope] = _Entry(Existing(job), time.monotonic() + lifetime, size)
        self._scope_of[job.id] = scope
        self._bytes += size
        while self._bytes > self._max_bytes:
            self._drop(next(iter(self._entries)))  # the least recently used

    def _on_change(self, job_id: str | None) -> None:
        """The store's feed announced a change of `job_id`, or of anything (None)."""
        self._sequence += 1
        if job_id is None:
            self._floor = self._sequence
            self._changed.clear()
            self._entries.clear()
            self._scope_of.clear()
            self._bytes = 0
            return
        self._changed[job_id] = self._sequence
        self._changed.move_to_end(job_id)
        if len(self._changed) > _TRACKED_CHANGES:
            _, oldest = self._changed.popitem(last=False)
            self._floor = max(self._floor, oldest)
        self._drop_job(job_id)

    def _drop_job(self, job_id: str) -> None:
        scope = self._scope_of.get(job_id)
        if scope is not None:
            self._drop(scope)

    def _drop(self, scope: tuple[str, str]) -> None:
        entry = self._entries.pop(scope, None)
        if entry is not None:
            self._bytes -= entry.size
            self._scope_of.pop(entry.found.job.id, None)
