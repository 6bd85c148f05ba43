"""A store in front of another: the base of the replay caches (store/redis/cache.py,
store/cache/memory.py).

`DelegatingStore(inner)` hands every call to `inner`, the source of truth; a cache overrides only
the calls it adds something to. It shares the inner store's `watch` (one set of waiters, woken
by every feed) and its metrics hook (which times the statements the inner store runs).

`ReplayCache` adds what both caches need to keep the job a winning completion wrote without
reading it back: the attempts this process added to jobs in flight (hedging), which the job
snapshot the runner holds does not count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from idemproxy.constants import CLOCK_MARGIN_SECONDS
from idemproxy.core.quota import QuotaLimits
from idemproxy.core.types import (
    Claimed,
    ClaimResult,
    Evidence,
    Intent,
    Job,
    JobState,
    KeptResponse,
    SealedResponse,
    StoredResponse,
)
from idemproxy.store.base import AttemptFailure, LateResponse, Store
from idemproxy.store.batching import GroupCommit

Observer = Callable[[str, float, bool], None]
# A cache entry that would live less than this (seconds) is not worth writing.
MIN_ENTRY_SECONDS = 0.5
# Hedged versions tracked at most: a version whose attempts never end here (the process's tasks
# cancelled) must not grow the map for ever. Forgetting one costs only a cached job's attempt
# count, which no replay shows; the stored job keeps the true one.
MAX_HEDGED_VERSIONS = 10_000


class DelegatingStore(Store):
    def __init__(self, inner: Store) -> None:
        self.inner = inner
        observer = inner.observer
        super().__init__()  # sets `observer` to None, through the property below
        self.observer = observer
        self.watch = inner.watch

    @property
    def observer(self) -> Observer | None:
        return self.inner.observer

    @observer.setter
    def observer(self, observer: Observer | None) -> None:
        self.inner.observer = observer

    def layer(self, kind: type[Store]) -> Store | None:
        """The first store of type `kind` in this chain, this one included."""
        store: Store = self
        while not isinstance(store, kind):
            if not isinstance(store, DelegatingStore):
                return None
            store = store.inner
        return store

    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def migrate(self) -> list[str]:
        return await self.inner.migrate()

    # --- the hot path -------------------------------------------------------------------------

    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        return await self.inner.claim(intent, job_id, upstream, ttl=ttl, lease=lease)

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
        return await self.inner.claim_within(
            intent, job_id, upstream, ttl=ttl, lease=lease, limits=limits
        )

    async def get(self, owner: str, key: str) -> Job | None:
        return await self.inner.get(owner, key)

    async def lookup(self, owner: str, key: str) -> Job | None:
        return await self.inner.lookup(owner, key)

    async def watch_job(self, owner: str, key: str) -> Job | None:
        return await self.inner.watch_job(owner, key)

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        return await self.inner.complete(job, attempt, response, ttl=ttl)

    async def settle(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> bool:
        return await self.inner.settle(job, attempt, state, status=status, error=error)

    async def finish_attempt(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> None:
        await self.inner.finish_attempt(job, attempt, state, status=status, error=error)

    async def start_next_attempt(
        self, job: Job, upstream: str, *, lease: float, token: str | None = None
    ) -> Claimed | None:
        return await self.inner.start_next_attempt(job, upstream, lease=lease, token=token)

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
        return await self.inner.fail_over(
            job, attempt, upstream, failure=failure, lease=lease, token=token
        )

    async def add_attempt(self, job: Job, upstream: str, *, lease: float) -> int | None:
        return await self.inner.add_attempt(job, upstream, lease=lease)

    async def renew_lease(self, job: Job, *, lease: float) -> bool:
        return await self.inner.renew_lease(job, lease=lease)

    async def take_over(self, job: Job) -> bool:
        return await self.inner.take_over(job)

    async def forget(self, job: Job) -> bool:
        return await self.inner.forget(job)

    # --- operators and housekeeping -----------------------------------------------------------

    async def get_by_id(self, job_id: str) -> Job | None:
        return await self.inner.get_by_id(job_id)

    async def late_response(self, job: Job, attempt: int) -> KeptResponse | None:
        return await self.inner.late_response(job, attempt)

    async def resolve(
        self,
        job: Job,
        state: JobState,
        *,
        response: KeptResponse | None = None,
        ttl: float = 0.0,
        resolution: str = "operator",
    ) -> bool:
        return await self.inner.resolve(
            job, state, response=response, ttl=ttl, resolution=resolution
        )

    async def claim_check(self, job: Job, attempt: int, *, checks: int, due_after: float) -> bool:
        return await self.inner.claim_check(job, attempt, checks=checks, due_after=due_after)

    async def record_evidence(self, job: Job, attempt: int, evidence: Evidence) -> None:
        await self.inner.record_evidence(job, attempt, evidence)

    async def note_sent(self, job: Job, attempt: int, digest: str) -> None:
        await self.inner.note_sent(job, attempt, digest)

    async def resend(
        self, job: Job, attempt: int, upstream: str, *, window: float, lease: float, token: str
    ) -> Claimed | None:
        return await self.inner.resend(
            job, attempt, upstream, window=window, lease=lease, token=token
        )

    async def delete(self, job: Job, *, force: bool = False) -> bool:
        return await self.inner.delete(job, force=force)

    async def stale_unknown(self, older_than: float, limit: int) -> list[Job]:
        return await self.inner.stale_unknown(older_than, limit)

    async def expired_leases(self, older_than: float, limit: int) -> list[Job]:
        return await self.inner.expired_leases(older_than, limit)

    async def sweep_expired(self, batch_size: int) -> int:
        return await self.inner.sweep_expired(batch_size)

    async def list_jobs(
        self, *, state: JobState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[Job]:
        return await self.inner.list_jobs(state=state, owner=owner, limit=limit)

    async def owner_jobs(
        self, owner: str, *, after: str, before: datetime, limit: int
    ) -> list[Job]:
        return await self.inner.owner_jobs(owner, after=after, before=before, limit=limit)

    async def count_unknown(self) -> int:
        return await self.inner.count_unknown()

    async def ping(self) -> None:
        await self.inner.ping()  # readiness is the source of truth's, not a cache's

    def group_commits(self) -> tuple[GroupCommit[Any, Any], ...]:
        return self.inner.group_commits()

    # --- encryption at rest ---------------------------------------------------------------------

    def opened(self, job: Job, response: KeptResponse) -> StoredResponse:
        return self.inner.opened(job, response)

    async def to_reseal(self, primary: str | None, after: Job | None, limit: int) -> list[Job]:
        return await self.inner.to_reseal(primary, after, limit)

    async def reseal(self, job: Job, sealed: SealedResponse) -> bool:
        return await self.inner.reseal(job, sealed)

    async def late_to_reseal(
        self, primary: str | None, after: LateResponse | None, limit: int
    ) -> list[LateResponse]:
        return await self.inner.late_to_reseal(primary, after, limit)

    async def reseal_late(self, late: LateResponse, sealed: SealedResponse) -> bool:
        return await self.inner.reseal_late(late, sealed)


class ReplayCache(DelegatingStore):
    def __init__(self, inner: Store) -> None:
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
        """The inner store's completion; when it won, the job as it wrote it and the seconds it
        may be kept (measured from before the store call, whose `now() + ttl` comes later: an
        entry never outlives its job). A completion lost or failed keeps nothing of the job."""
        started, now = time.monotonic(), time.time()
        won = False
        try:
            won = await self.inner.complete(job, attempt, response, ttl=ttl)
        finally:
            if not won:
                self._hedged.pop((job.id, job.version), None)
        if not won:
            return None
        done = self._completed_job(job, attempt, response, expires_at=now + ttl)
        return done, ttl - (time.monotonic() - started)

    def _completed_job(
        self, job: Job, attempt: int, response: KeptResponse, *, expires_at: float
    ) -> Job:
        """The job as the completion by `attempt` that just won wrote it (queries.sql
        `complete`); `expires_at` a time.time() no later than the store's."""
        hedged = self._hedged.pop((job.id, job.version), 0) if self._hedged else 0
        # Positional, not `job._replace(...)`: a third of the time, on every new key.
        (job_id, owner, key, fingerprint, _, version, count, method, path) = job[:9]
        return Job(
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
            datetime.fromtimestamp(expires_at, tz=UTC),
            False,
            False,
            job.resolution,
            job.attempts,
        )


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
