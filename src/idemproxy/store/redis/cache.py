"""A Redis replay cache and cross-replica wake-ups in front of a store (SPEC §11, optional).

`RedisCachedStore(inner, client)` is a layer in front of the hot path (store/layers.py): every
decision is the store of record's (PostgreSQL in production), and it adds two things:

* a hot replay cache: `claim` first looks up a cached *completed* job for (owner, key), with a
  short timeout; a hit is `Existing(job)`, and the decision core replays it or answers
  payload-mismatch exactly as it would from the store. Completed jobs are immutable, so a hit
  is as good as a read. Anything else (a miss, an error, a late answer) goes to `inner.claim`.
  Winning completions, and completed jobs that `claim`/`get` read from the store, are written
  back in the background for at most `ttl` seconds and never past the job's own expiry.
* wake-ups across replicas: a held duplicate marks its key watched in Redis, and each state
  change of a watched job made through this process is published on a channel that every
  replica subscribes to (store/redis/feed.py), waking held duplicates there too. The `watch` is
  the store of record's own, so its feed (PostgreSQL LISTEN) and Redis wake the same waiters.

An operator's deletion, resolution or resealing reaches the store of record directly; this
cache learns of it through the record's hooks (`deleting`, `changed`). Deletion: the entry is
invalidated and the job tombstoned in Redis *before* it is deleted in the store; the cache
write script refuses a tombstoned job, so a write that was already on its way cannot resurrect
it, and readers reject an entry whose job has expired. Redis failing is a cache miss; its
errors never leave store/redis/client.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from idemproxy.constants import CLOCK_MARGIN_SECONDS
from idemproxy.core.types import (
    ClaimResult,
    Existing,
    Intent,
    Job,
    JobState,
    KeptResponse,
)
from idemproxy.store.base import Store
from idemproxy.store.cache.memory import (
    MIN_ENTRY_SECONDS,
    ReplayCache,
    body_bytes,
    seconds_left,
)
from idemproxy.store.feed import stop_feed
from idemproxy.store.hooks import Change
from idemproxy.store.layers import JobLayer
from idemproxy.store.redis.client import EntryKeys, RedisCache, connect
from idemproxy.store.redis.codec import (
    Tags,
    decode,
    encode,
    entry_name,
    tombstone_name,
    watch_name,
)
from idemproxy.store.redis.feed import listen_forever

log = logging.getLogger("idemproxy.store.redis")


@dataclass(frozen=True, slots=True)
class RedisCacheOptions:
    """How the cache talks to Redis and what it keeps (the `redis:` settings, SPEC §11)."""

    timeout: float = 0.05  # seconds a lookup may take before it counts as a miss
    write_timeout: float = 0.5  # seconds for a background write, and the client's socket timeout
    ttl: float = 300.0  # longest an entry is kept (never past its job's expiry)
    max_body: int = 1 << 20  # larger responses are not cached


_DEFAULT_OPTIONS = RedisCacheOptions()


class RedisCachedStore(ReplayCache):
    def __init__(
        self,
        inner: Store | JobLayer,
        client: Redis,
        options: RedisCacheOptions = _DEFAULT_OPTIONS,
        tags: Tags | None = None,
    ) -> None:
        """`tags`: with encryption at rest, what entries are tagged with under the key ring
        (codec.py): an entry whose fields someone changed is then a miss."""
        super().__init__(inner)
        self.cache = RedisCache(
            client, timeout=options.timeout, write_timeout=options.write_timeout
        )
        self._ttl = options.ttl
        self._max_body = options.max_body
        self._tags = tags
        self._feed: asyncio.Task[None] | None = None
        self.record.hooks.append(self)

    @classmethod
    def from_url(
        cls,
        inner: Store | JobLayer,
        url: str,
        options: RedisCacheOptions = _DEFAULT_OPTIONS,
        tags: Tags | None = None,
    ) -> RedisCachedStore:
        return cls(inner, connect(url, timeout=options.write_timeout), options, tags)

    async def open(self) -> None:
        where = self.cache.client.connection_pool.connection_kwargs  # never the password
        log.info("replay cache and wake-ups on redis %s", where.get("path") or where.get("host"))
        # Redis may be down at start-up: the feed keeps trying, lookups miss until it is up.
        self._feed = asyncio.create_task(
            listen_forever(self.cache.client, self.watch, self.cache), name="idemproxy-redis-feed"
        )

    async def close(self) -> None:
        if self._feed is not None:
            await stop_feed(self._feed)
        await self.cache.close()

    # --- the hot path -------------------------------------------------------------------------

    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        cached = await self.cached(intent.owner, intent.key)
        if cached is not None:
            return Existing(cached)
        result = await self.inner.claim(intent, job_id, upstream, ttl=ttl, lease=lease)
        if isinstance(result, Existing):
            self._remember(result.job)
        return result

    async def cached(self, owner: str, key: str) -> Job | None:
        """The completed job cached for (owner, key), if Redis has it in time."""
        started = time.perf_counter()
        payload = await self.cache.get(entry_name(owner, key))
        job = None if payload is None else decode(payload, owner, key, self._tags)
        if job is not None and seconds_left(job, self.watch.clock_offset) <= 0:
            job = None  # SPEC §11: an expired job is gone, whatever a late write left behind
        if self.observer is not None:  # store_seconds{operation="redis_hit"|"redis_miss"}
            outcome = "redis_miss" if job is None else "redis_hit"
            self.observer(outcome, time.perf_counter() - started, False)
        return job

    async def lookup(self, owner: str, key: str) -> Job | None:
        job = await self.cached(owner, key)
        if job is not None:
            return job
        job = await self.inner.lookup(owner, key)
        if job is not None:
            self._remember(job)
        return job

    async def get(self, owner: str, key: str) -> Job | None:
        job = await self.inner.get(owner, key)
        if job is not None:
            self._remember(job)
        return job

    async def watch_job(self, owner: str, key: str) -> Job | None:
        # Marked before the store re-reads the job: a change committed after that re-read is
        # announced through Redis too (a change before it, the re-read sees).
        await self.cache.watching(watch_name(entry_name(owner, key)))
        return await self.inner.watch_job(owner, key)

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        completed = await self.complete_in_store(job, attempt, response, ttl=ttl)
        if completed is None:
            return False
        done, lifetime = completed
        self._remember(done, lifetime=lifetime, publish=True)
        return True

    async def settle(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> bool:
        won = await super().settle(job, attempt, state, status=status, error=error)
        if won:
            self._announce(job)
        return won

    async def take_over(self, job: Job) -> bool:
        won = await self.inner.take_over(job)
        if won:
            self._announce(job)
        return won

    async def forget(self, job: Job) -> bool:
        forgotten = await self.inner.forget(job)
        if forgotten:  # expired: readers reject its entry anyway; dropping it frees the memory
            self._drop_soon(job)
        return forgotten

    # --- changes made past the hot path (store.hooks.ChangeHook) ---------------------------------

    async def deleting(self, job: Job) -> None:
        # Invalidate first: from here on no replica replays it from Redis, and a cache write
        # for it still on its way is refused by the tombstone until the job would have expired.
        name = entry_name(job.owner, job.key)
        expires = job.expires_at.timestamp() if job.expires_at else time.time() + self._ttl
        until = max(expires, time.time()) + CLOCK_MARGIN_SECONDS
        await self.cache.drop(name, tombstone_name(name, job.id), until)

    def changed(self, job: Job, change: Change, won: bool) -> None:
        if not won:
            return
        if change is not Change.DELETED:
            # A resolved job was unknown, never cached: dropped all the same. A resealed one's
            # entry holds the box under the old key, which may be retired next (SPEC §11).
            self._drop_soon(job)
        if change is not Change.RESEALED:
            self._announce(job)

    # --- the cache ------------------------------------------------------------------------------

    def _remember(self, job: Job, *, lifetime: float | None = None, publish: bool = False) -> None:
        """Cache a completed job (best effort, in the background) for at most `ttl` seconds and
        never past its expiry; with `publish`, announce its change to every replica too."""
        if lifetime is None:
            lifetime = seconds_left(job, self.watch.clock_offset)
        ttl = min(self._ttl, lifetime)
        name = entry_name(job.owner, job.key)
        if self._cacheable(job) and ttl >= MIN_ENTRY_SECONDS:
            keys = EntryKeys(name, tombstone_name(name, job.id), watch_name(name))
            self.cache.put(keys, encode(job, self._tags), ttl, job.id if publish else "")
        elif publish:
            self._announce(job)

    def _announce(self, job: Job) -> None:
        self.cache.announce(watch_name(entry_name(job.owner, job.key)), job.id)

    def _cacheable(self, job: Job) -> bool:
        response = job.response
        return (
            job.state is JobState.COMPLETED
            and not job.expired
            and job.expires_at is not None
            and response is not None
            and body_bytes(response) <= self._max_body
        )

    def _drop_soon(self, job: Job) -> None:
        name = entry_name(job.owner, job.key)
        self.cache.drop_soon(name, tombstone_name(name, job.id))
