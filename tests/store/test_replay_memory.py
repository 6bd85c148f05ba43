"""The in-process replay cache (store/cache/memory.py) against a real PostgreSQL: what it serves,
and everything that must make it stop serving a job."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idemproxy.config.settings import load_settings
from idemproxy.core.types import Claimed, ClaimResult, Existing, JobState, StoredResponse
from idemproxy.errors import StoreUnavailable
from idemproxy.store.base import Store
from idemproxy.store.cache.memory import ENTRY_OVERHEAD_BYTES, MemoryReplayCache
from idemproxy.store.factory import serving_store
from idemproxy.store.layers import Stacked, StoreStack
from idemproxy.store.ports import JobStore
from idemproxy.store.postgres import listen as pg_listen
from idemproxy.store.postgres.store import PostgresStore
from tests.support.stores import CacheBounds

from .conftest import eventually, wait_until_live
from .test_contract import LEASE, RESPONSE, TTL, claim, intent

pytestmark = pytest.mark.postgres

BOUNDS: CacheBounds = {"max_bytes": 1 << 20, "max_body": 4096, "ttl": 60.0}


@pytest.fixture
async def cached(pg_dsn: str) -> AsyncIterator[MemoryReplayCache]:
    cache = MemoryReplayCache(PostgresStore(pg_dsn), **BOUNDS)
    stack = StoreStack.of(cache)
    await stack.open()
    try:
        await wait_until_live(cache.watch)
        yield cache
    finally:
        await stack.close()


@pytest.fixture
async def other_process(pg_dsn: str) -> AsyncIterator[Store]:
    """What `idemproxy jobs delete` or another replica holds: a store of its own."""
    store = PostgresStore(pg_dsn, listen=False)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


class StoreCalls:
    """Counts the statements the PostgreSQL store runs, by operation (its metrics hook)."""

    def __init__(self, store: Stacked) -> None:
        self.seen: list[str] = []
        StoreStack.of(store).record.observer = lambda operation, _seconds, _failed: (
            self.seen.append(operation)
        )

    def count(self, operation: str) -> int:
        return self.seen.count(operation)


async def again(store: JobStore, key: str = "k1", owner: str = "alice", fp: str = "fp1") -> Any:
    job_id = str(uuid.uuid4())
    return await store.claim(intent(key, owner, fp), job_id, "primary", ttl=TTL, lease=LEASE)


async def complete(
    store: JobStore, key: str = "k1", response: StoredResponse = RESPONSE
) -> Claimed:
    claimed = await claim(store, key)
    assert await store.complete(claimed.job, 1, response, ttl=TTL)
    return claimed


async def test_a_duplicate_of_a_completed_job_is_answered_without_the_store(
    cached: MemoryReplayCache,
) -> None:
    calls = StoreCalls(cached)
    claimed = await complete(cached)
    replay = await again(cached)
    assert isinstance(replay, Existing)
    assert replay.job.id == claimed.job.id
    assert replay.job.state is JobState.COMPLETED
    assert replay.job.response == RESPONSE
    assert replay.job.completed_by == 1
    assert calls.count("claim") == 1  # the first request's only
    assert cached.hits == 1


async def test_a_job_read_from_the_store_is_kept_for_the_next_duplicate(
    cached: MemoryReplayCache, other_process: Store
) -> None:
    finished = await complete(other_process)  # completed by another replica
    calls = StoreCalls(cached)
    for _ in range(3):
        replay = await again(cached)
        assert isinstance(replay, Existing) and replay.job.id == finished.job.id
        assert replay.job.response == RESPONSE
    assert calls.count("claim") == 1
    assert cached.hits == 2


async def test_the_fingerprint_and_owner_travel_with_the_cached_job(
    cached: MemoryReplayCache,
) -> None:
    await complete(cached)
    other_payload = await again(cached, fp="another")
    assert isinstance(other_payload, Existing)
    assert other_payload.job.fingerprint == "fp1"  # the decision core answers 409 from this
    other_tenant = await again(cached, owner="mallory")
    assert isinstance(other_tenant, Claimed)  # never alice's job


async def test_jobs_that_are_not_completed_are_never_kept(cached: MemoryReplayCache) -> None:
    in_flight = await claim(cached, "running")
    assert isinstance(await again(cached, "running"), Existing)
    released = await claim(cached, "released")
    assert await cached.settle(released.job, 1, JobState.RELEASED, status=503)
    unknown = await claim(cached, "unknown")
    assert await cached.settle(unknown.job, 1, JobState.UNKNOWN, error="timeout")
    for key in ("running", "released", "unknown"):
        assert isinstance(await again(cached, key), Existing)
    assert cached.entries == 0 and cached.hits == 0
    assert in_flight.job.state is JobState.IN_FLIGHT


async def test_a_deletion_by_another_process_is_seen_through_the_feed(
    cached: MemoryReplayCache, other_process: Store
) -> None:
    claimed = await complete(cached)
    assert cached.entries == 1
    job = await other_process.get_by_id(claimed.job.id)
    assert job is not None and await other_process.delete(job)
    await eventually(lambda: cached.entries == 0, "the deletion is seen")
    assert isinstance(await again(cached), Claimed)  # the key is free again


async def test_an_operators_deletion_in_this_process_drops_the_entry_at_once(
    cached: MemoryReplayCache,
) -> None:
    claimed = await complete(cached)
    job = await cached.record.get_by_id(claimed.job.id)
    assert job is not None and await cached.record.delete(job)
    assert cached.entries == 0
    assert isinstance(await again(cached), Claimed)


async def test_a_read_under_way_while_its_job_is_announced_is_not_kept(
    cached: MemoryReplayCache, other_process: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    finished = await complete(other_process)
    inner_claim = cached.inner.claim

    async def announced_meanwhile(*args: Any, **kwargs: Any) -> ClaimResult:
        result = await inner_claim(*args, **kwargs)
        cached.watch.notify(finished.job.id)  # e.g. its deletion, committed after the read
        return result

    monkeypatch.setattr(cached.inner, "claim", announced_meanwhile)
    assert isinstance(await again(cached), Existing)
    assert cached.entries == 0
    monkeypatch.setattr(cached.inner, "claim", inner_claim)
    assert isinstance(await again(cached), Existing)
    assert cached.entries == 1  # a read begun after the announcement is kept


@pytest.mark.parametrize("announcements", [1, 2000])
async def test_a_read_under_way_when_anything_may_have_changed_is_not_kept(
    cached: MemoryReplayCache,
    other_process: Store,
    monkeypatch: pytest.MonkeyPatch,
    announcements: int,
) -> None:
    """The feed reconnected (`notify_all`, changes may have passed unseen), or more jobs were
    announced than the cache tracks one by one: any read under way may predate a change."""
    await complete(other_process)
    inner_claim = cached.inner.claim

    async def announced_meanwhile(*args: Any, **kwargs: Any) -> ClaimResult:
        result = await inner_claim(*args, **kwargs)
        if announcements == 1:
            cached.watch.notify_all()
        for _ in range(announcements if announcements > 1 else 0):
            cached.watch.notify(str(uuid.uuid4()))
        return result

    monkeypatch.setattr(cached.inner, "claim", announced_meanwhile)
    assert isinstance(await again(cached), Existing)
    assert cached.entries == 0


async def test_an_announcement_of_another_job_does_not_stop_a_read_being_kept(
    cached: MemoryReplayCache, other_process: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    await complete(other_process)
    inner_claim = cached.inner.claim

    async def announced_meanwhile(*args: Any, **kwargs: Any) -> ClaimResult:
        result = await inner_claim(*args, **kwargs)
        cached.watch.notify(str(uuid.uuid4()))
        return result

    monkeypatch.setattr(cached.inner, "claim", announced_meanwhile)
    await again(cached)
    assert cached.entries == 1


async def test_losing_the_feed_empties_the_cache_and_serves_nothing_until_it_is_back(
    cached: MemoryReplayCache, pg_dsn: str
) -> None:
    await complete(cached, "a")
    await complete(cached, "b")
    assert cached.entries == 2
    calls = StoreCalls(cached)
    conn = await asyncpg.connect(pg_dsn)
    try:  # the LISTEN connection's backend is killed, as a failover or an idle killer would
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            # The feed's session: its last statement is LISTEN or the heartbeat's clock read.
            " AND (query LIKE 'LISTEN%' OR query LIKE '%clock_timestamp()%')"
        )
    finally:
        await conn.close()
    assert killed == 1
    await eventually(lambda: cached.entries == 0, "the cache is emptied")
    await wait_until_live(cached.watch)  # the feed reconnects by itself
    assert isinstance(await again(cached, "a"), Existing)
    assert calls.count("claim") == 1  # re-read from the store, then kept again
    assert isinstance(await again(cached, "a"), Existing)
    assert calls.count("claim") == 1 and cached.entries == 1


async def test_nothing_is_served_or_kept_while_the_feed_is_not_live(
    cached: MemoryReplayCache,
) -> None:
    await complete(cached)
    calls = StoreCalls(cached)
    cached.watch.live = False
    assert isinstance(await again(cached), Existing)
    assert calls.count("claim") == 1 and cached.hits == 0
    await complete(cached, "k2")
    assert cached.entries == 0


async def test_an_entry_never_outlives_its_job(cached: MemoryReplayCache) -> None:
    claimed = await claim(cached, "short", ttl=1.5)
    assert await cached.complete(claimed.job, 1, RESPONSE, ttl=1.5)
    assert cached.entries == 1
    await asyncio.sleep(1.6)
    expired = await again(cached, "short")
    assert isinstance(expired, Existing)
    assert expired.job.expired  # the store's answer: the decision core forgets and re-claims
    assert cached.hits == 0


async def test_a_job_about_to_expire_is_not_kept(cached: MemoryReplayCache) -> None:
    claimed = await claim(cached, "brief", ttl=0.3)
    assert await cached.complete(claimed.job, 1, RESPONSE, ttl=0.3)
    assert cached.entries == 0


async def test_the_least_recently_replayed_go_first_and_the_bound_holds(pg_dsn: str) -> None:
    response = StoredResponse(200, (), b"x" * 1000)
    entry = ENTRY_OVERHEAD_BYTES + 1000 + len("k0")
    cache = MemoryReplayCache(PostgresStore(pg_dsn), max_bytes=3 * entry, max_body=4096, ttl=60)
    stack = StoreStack.of(cache)
    await stack.open()
    try:
        await wait_until_live(cache.watch)
        for key in ("k0", "k1", "k2"):
            await complete(cache, key, response)
        assert isinstance(await again(cache, "k0"), Existing)  # k0 is now the most recent
        await complete(cache, "k3", response)
        assert cache.entries == 3 and cache.size <= 3 * entry
        calls = StoreCalls(cache)
        for key in ("k0", "k2", "k3"):
            await again(cache, key)
        assert calls.count("claim") == 0  # k1 went, the others stayed
        await again(cache, "k1")
        assert calls.count("claim") == 1
    finally:
        await stack.close()


async def test_large_bodies_are_replayed_from_the_store(cached: MemoryReplayCache) -> None:
    await complete(cached, "big", StoredResponse(200, (), b"x" * (BOUNDS["max_body"] + 1)))
    await complete(cached, "omitted", StoredResponse(200, (), None))
    assert cached.entries == 1  # the omitted body (SPEC §7) is kept: it is small


async def test_sweeping_and_forgetting_drop_nothing_live(cached: MemoryReplayCache) -> None:
    await complete(cached)
    assert await cached.record.sweep_expired(100) == 0
    assert isinstance(await again(cached), Existing)
    assert cached.hits == 1


@pytest.mark.parametrize(
    ("dsn_fixture", "settings", "expected"),
    [
        ("pg_dsn", {}, True),
        ("pg_dsn", {"replay_cache": {"max_bytes": 0}}, False),
        ("sqlite_dsn", {}, False),  # other processes' deletions are not announced
    ],
)
def test_which_stores_have_the_cache(
    request: pytest.FixtureRequest, dsn_fixture: str, settings: dict[str, Any], expected: bool
) -> None:
    dsn = request.getfixturevalue(dsn_fixture)
    store = serving_store(load_settings(store=dsn, upstream="http://127.0.0.1:9", **settings))
    assert isinstance(store, MemoryReplayCache) is expected
    if isinstance(store, MemoryReplayCache):
        assert isinstance(store.inner, PostgresStore)


async def test_a_kept_completion_counts_the_attempts_added_while_it_ran(
    cached: MemoryReplayCache,
) -> None:
    """Hedging adds attempts without a new version; the job the runner holds does not count
    them, the cached job must (found by the model test)."""
    claimed = await claim(cached)
    assert await cached.add_attempt(claimed.job, "fallback", lease=LEASE) == 2
    assert await cached.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    replay = await again(cached)
    stored = await cached.inner.get("alice", "k1")
    assert isinstance(replay, Existing) and cached.hits == 1
    assert stored is not None and replay.job.attempt_count == stored.attempt_count == 2


async def test_a_completion_that_fails_leaves_nothing_behind(
    cached: MemoryReplayCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hedging count of a job whose completion raised is dropped with it (no leak)."""
    claimed = await claim(cached)
    assert await cached.add_attempt(claimed.job, "fallback", lease=LEASE) == 2

    async def store_down(*_args: Any, **_kwargs: Any) -> bool:
        raise StoreUnavailable("down")

    monkeypatch.setattr(cached.inner, "complete", store_down)
    with pytest.raises(StoreUnavailable):
        await cached.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    assert cached.entries == 0
    assert not cached._hedged  # the leak this test is about


async def test_the_feed_measures_this_hosts_clock_against_the_databases(
    cached: MemoryReplayCache,
) -> None:
    assert abs(cached.watch.clock_offset) < 0.5  # one machine here: the same clock


@pytest.fixture
def quick_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """The change feed measures the clock offset again every 0.3 s, not every 5 s: set up
    before the cache opens, so that its first wait is the short one too."""
    monkeypatch.setattr(pg_listen, "_HEARTBEAT_SECONDS", 0.3)


async def test_a_job_read_from_the_store_is_kept_until_its_expiry_by_the_databases_clock(
    quick_heartbeat: None,
    cached: MemoryReplayCache,
    other_process: Store,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A proxy whose clock is 30 s slow would, by its own clock, keep a job 30 s past its
    expiry, when the key already names a new intent (SPEC §11)."""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - 30.0)
    await eventually(lambda: cached.watch.clock_offset > 29.0, "the offset measured", seconds=10)
    claimed = await claim(other_process, "soon", ttl=20.0)
    assert await other_process.complete(claimed.job, 1, RESPONSE, ttl=20.0)
    assert isinstance(await again(cached, "soon"), Existing)
    [entry] = cached._entries.values()  # the entry this test is about
    assert 17.0 < entry.deadline - time.monotonic() <= 19.0  # 20 s, less the margin
