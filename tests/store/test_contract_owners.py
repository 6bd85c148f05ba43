"""The store contract for quotas and erasure (SPEC §9, §11), on every store (and the cache)."""

from __future__ import annotations

import asyncio

from idemproxy.core.quota import QuotaLimits
from idemproxy.core.types import Claimed, Existing, Intent, JobState, StoredResponse
from idemproxy.identity.intent import new_job_id
from idemproxy.store.ports import JobStore

TTL, LEASE = 600.0, 30.0
SHORT, PAST_SHORT = 0.2, 0.35  # a lease that runs out, and a sleep past it (database clock)
UPSTREAM = "http://upstream:3000"
FIRST = "00000000-0000-0000-0000-000000000000"


def _intent(key: str, owner: str = "alice") -> Intent:
    return Intent(owner, key, "fp", "POST", "/charges")


async def _claim_within(
    hot: JobStore, key: str, limits: QuotaLimits, owner: str = "alice", lease: float = LEASE
) -> object:
    return await hot.claim_within(
        _intent(key, owner), new_job_id(), UPSTREAM, ttl=TTL, lease=lease, limits=limits
    )


async def test_in_flight_cap_counts_live_jobs_and_never_refuses_an_existing_key(
    hot: JobStore,
) -> None:
    limits = QuotaLimits(in_flight=1)
    first = await _claim_within(hot, "a", limits)
    assert isinstance(first, Claimed)
    assert await _claim_within(hot, "b", limits) == "in_flight"
    assert await hot.get("alice", "b") is None  # nothing claimed
    assert isinstance(await _claim_within(hot, "a", limits), Existing)  # a duplicate
    assert isinstance(await _claim_within(hot, "b", limits, owner="bob"), Claimed)
    done = StoredResponse(201, (), b"ok")
    assert await hot.complete(first.job, 1, done, ttl=TTL)
    assert isinstance(await _claim_within(hot, "b", limits), Claimed)


async def test_in_flight_counts_each_job_once_while_its_renewed_lease_lives(
    hot: JobStore,
) -> None:
    """SPEC §9, §3.5: a job counts by its lease as renewed, not the one its attempt started
    with; a hedged job (two attempts, SPEC §3.4) counts once, until it ends; a job whose lease
    ran out (its proxy died) does not count."""
    limits = QuotaLimits(in_flight=3)
    renewed = await _claim_within(hot, "renewed", limits, lease=SHORT)
    assert isinstance(renewed, Claimed)
    assert await hot.renew_lease(renewed.job, lease=LEASE)
    hedged = await _claim_within(hot, "hedged", limits)
    assert isinstance(hedged, Claimed)
    assert await hot.add_attempt(hedged.job, UPSTREAM, lease=LEASE) == 2
    await hot.finish_attempt(hedged.job, 1, JobState.RELEASED, status=503, error="busy")
    dead = await _claim_within(hot, "dead", QuotaLimits(in_flight=1), owner="bob", lease=SHORT)
    assert isinstance(dead, Claimed)
    await asyncio.sleep(PAST_SHORT)
    assert isinstance(await _claim_within(hot, "third", limits), Claimed)  # 2 in flight
    assert await _claim_within(hot, "fourth", limits) == "in_flight"  # 3
    assert isinstance(
        await _claim_within(hot, "next", QuotaLimits(in_flight=1), owner="bob"), Claimed
    )
    assert await hot.settle(hedged.job, 2, JobState.RELEASED, status=503, error="busy")
    assert isinstance(await _claim_within(hot, "fourth", limits), Claimed)


async def test_rate_and_stored_bytes(hot: JobStore) -> None:
    assert isinstance(await _claim_within(hot, "r1", QuotaLimits(new_per_second=1)), Claimed)
    assert await _claim_within(hot, "r2", QuotaLimits(new_per_second=1)) == "new_per_second"
    claimed = await _claim_within(hot, "s1", QuotaLimits(stored_bytes=4), owner="carol")
    assert isinstance(claimed, Claimed)
    assert await hot.complete(claimed.job, 1, StoredResponse(200, (), b"12345"), ttl=TTL)
    assert await _claim_within(hot, "s2", QuotaLimits(stored_bytes=4), owner="carol") == (
        "stored_bytes"
    )
    assert isinstance(
        await _claim_within(hot, "s2", QuotaLimits(stored_bytes=6), owner="carol"), Claimed
    )


async def test_concurrent_new_keys_cannot_store_past_the_bytes_limit(hot: JobStore) -> None:
    """SPEC §9: each job in flight counts as `max_body` toward `stored_bytes`, so new keys
    claimed at once are refused once their possible responses would fill the limit."""
    limits = QuotaLimits(stored_bytes=100, max_body=30)
    results = await asyncio.gather(
        *(_claim_within(hot, f"c{n}", limits, owner="dora") for n in range(40))
    )
    claimed = [result for result in results if isinstance(result, Claimed)]
    assert len(claimed) == 4  # 0, 30, 60, 90 < 100: the fifth would make 120
    assert results.count("stored_bytes") == 36
    for one in claimed:
        assert await hot.complete(one.job, 1, StoredResponse(200, (), b"x" * 30), ttl=TTL)
    assert 30 * len(claimed) <= 100 + limits.max_body  # the bound SPEC §9 gives
    assert await _claim_within(hot, "later", limits, owner="dora") == "stored_bytes"
