"""What both replay caches (store/redis/cache.py, store/cache/memory.py) need besides their
entries: to keep the job a winning completion wrote without reading it back, the attempts this
process added to jobs in flight (hedging), which the job snapshot the runner holds does not
count; and how long an entry may live.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from idemproxy.constants import CLOCK_MARGIN_SECONDS
from idemproxy.core.types import Job, JobState, KeptResponse, SealedResponse
from idemproxy.store.base import Store
from idemproxy.store.layers import JobLayer

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
