"""The store contract of the hot path (SPEC §2, §3, §11): claim, complete, settle, the next
attempt, expiry and watching, through the layers in front of the store (`hot`), on every store
of tests/store/conftest.py. Leases, takeover, fail-over and hedging: test_contract_attempts.py;
the other interfaces: test_contract_{operators,housekeeping,lifecycle}.py, and sealing and
resealing: test_contract_sealed.py."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest

from idemproxy.core.types import (
    AttemptState,
    Claimed,
    Existing,
    Intent,
    Job,
    JobState,
    StoredResponse,
)
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from idemproxy.store.ports import JobStore, Operators

TTL = 3600.0
LEASE = 30.0
WAKE_TIMEOUT = 5.0  # an upper bound: a woken subscriber returns at once
QUIET = 0.05  # how long "nothing happened" is watched for

RESPONSE = StoredResponse(
    201,
    (("Content-Type", "application/octet-stream"), ("X-Dup", "a"), ("x-dup", "b"), ("X-Dup", "a")),
    b"\x00\xff\xfe not utf-8 \x80\xc3\x28",
)
LATE_RESPONSE = StoredResponse(200, (("X-Late", "yes"),), b"late")


def intent(key: str = "k1", owner: str = "alice", fingerprint: str = "fp1") -> Intent:
    return Intent(owner=owner, key=key, fingerprint=fingerprint, method="POST", path="/charges")


async def claim(hot: JobStore, key: str = "k1", owner: str = "alice", ttl: float = TTL) -> Claimed:
    result = await hot.claim(intent(key, owner), str(uuid.uuid4()), "primary", ttl=ttl, lease=LEASE)
    assert isinstance(result, Claimed)
    return result


async def job_of(operators: Operators, job_id: str) -> Job:
    job = await operators.get_by_id(job_id)
    assert job is not None
    return job


async def completed(hot: JobStore, operators: Operators, key: str = "k1", ttl: float = TTL) -> Job:
    claimed = await claim(hot, key, ttl=ttl)
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=ttl)
    return await job_of(operators, claimed.job.id)


async def settled(
    hot: JobStore, operators: Operators, state: JobState, key: str = "k1", ttl: float = TTL
) -> Job:
    claimed = await claim(hot, key, ttl=ttl)
    assert await hot.settle(claimed.job, 1, state, status=503, error="upstream said 503")
    return await job_of(operators, claimed.job.id)


def ids(jobs: list[Job]) -> set[str]:
    return {job.id for job in jobs}


def states(job: Job) -> list[AttemptState]:
    return [attempt.state for attempt in job.attempts]


@contextlib.asynccontextmanager
async def open_store(dsn: str) -> AsyncIterator[Store]:
    store = create_store(dsn)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def wait_until_listening(hot: JobStore) -> None:
    """PostgreSQL starts LISTEN in the background: once a probe job's wake-up arrives, it is up."""
    probe = await claim(hot, key="feed-probe")
    async with hot.watching(probe.job.id) as sub:
        await hot.watch_job(probe.job.owner, probe.job.key)
        assert await hot.complete(probe.job, 1, RESPONSE, ttl=TTL)
        assert await sub.wait(WAKE_TIMEOUT)


# --- claim ------------------------------------------------------------------------------------


async def test_claim_creates_job_and_first_attempt(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    job = await job_of(operators, claimed.job.id)
    assert claimed.attempt == 1
    assert job == claimed.job._replace(attempts=job.attempts)
    assert (job.owner, job.key, job.fingerprint) == ("alice", "k1", "fp1")
    assert (job.method, job.path, job.state) == ("POST", "/charges", JobState.IN_FLIGHT)
    assert (job.attempt_count, job.completed_by, job.response) == (1, None, None)
    assert [(a.number, a.upstream, a.state) for a in job.attempts] == [
        (1, "primary", AttemptState.STARTED)
    ]
    assert job.attempts[0].started_at is not None
    assert job.attempts[0].finished_at is None


async def test_times_are_aware_datetimes_from_one_clock(hot: JobStore) -> None:
    job = (await claim(hot)).job
    assert job.created_at is not None and job.created_at.tzinfo is not None
    assert job.expires_at is not None and job.expires_at.tzinfo is not None
    assert abs(job.expires_at - job.created_at - timedelta(seconds=TTL)) < timedelta(seconds=1)
    assert not job.expired


async def test_get_finds_the_job_by_owner_and_key(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    found = await hot.get("alice", "k1")
    assert found is not None and found.id == claimed.job.id
    assert await hot.get("bob", "k1") is None
    assert await hot.get("alice", "k2") is None
    assert await operators.get_by_id(str(uuid.uuid4())) is None
    assert await operators.get_by_id("not-a-job-id") is None  # not a store outage


async def test_second_claim_returns_the_existing_job_untouched(
    hot: JobStore, operators: Operators
) -> None:
    first = await claim(hot)
    other_id = str(uuid.uuid4())
    second = await hot.claim(intent(fingerprint="fp2"), other_id, "other", ttl=TTL, lease=LEASE)
    assert isinstance(second, Existing)
    assert second.job == first.job  # same id, fingerprint, version
    job = await job_of(operators, first.job.id)
    assert job.version == first.job.version
    assert states(job) == [AttemptState.STARTED]
    assert await operators.get_by_id(other_id) is None


async def test_same_key_under_different_owners_is_two_jobs(
    hot: JobStore, operators: Operators
) -> None:
    alice = await claim(hot, owner="alice")
    bob = await claim(hot, owner="bob")
    assert alice.job.id != bob.job.id
    assert [job.id for job in await operators.list_jobs(owner="bob")] == [bob.job.id]


async def test_concurrent_claims_of_one_key_have_one_winner(
    hot: JobStore, operators: Operators
) -> None:
    ids = [str(uuid.uuid4()) for _ in range(50)]
    results = await asyncio.gather(
        *(hot.claim(intent(), job_id, "primary", ttl=TTL, lease=LEASE) for job_id in ids)
    )
    winners = [r for r in results if isinstance(r, Claimed)]
    assert len(winners) == 1
    assert {r.job.id for r in results} == {winners[0].job.id}
    assert len((await job_of(operators, winners[0].job.id)).attempts) == 1


# --- complete ---------------------------------------------------------------------------------


async def test_complete_stores_the_response_exactly(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    job = await job_of(operators, claimed.job.id)
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 1)
    assert job.version == claimed.job.version + 1
    assert job.response == RESPONSE  # status, header order and duplicates, raw body bytes
    assert job.attempts[0].state is AttemptState.SUCCEEDED
    assert (job.attempts[0].status, job.attempts[0].finished_at is not None) == (201, True)


@pytest.mark.parametrize("body", [None, b""], ids=["omitted", "empty"])
async def test_omitted_and_empty_bodies_round_trip(
    hot: JobStore, operators: Operators, body: bytes | None
) -> None:
    claimed = await claim(hot)
    assert await hot.complete(claimed.job, 1, StoredResponse(200, (), body), ttl=TTL)
    response = (await job_of(operators, claimed.job.id)).response
    assert response == StoredResponse(200, (), body)
    assert response.omitted is (body is None)


async def test_complete_wins_only_once(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    assert not await hot.complete(claimed.job, 1, LATE_RESPONSE, ttl=TTL)
    job = await job_of(operators, claimed.job.id)
    assert (job.response, job.version) == (RESPONSE, claimed.job.version + 1)
    assert states(job) == [AttemptState.SUCCEEDED]


async def test_losing_attempt_is_discarded(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    assert await hot.add_attempt(claimed.job, "fallback", lease=LEASE) == 2
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    assert not await hot.complete(claimed.job, 2, LATE_RESPONSE, ttl=TTL)
    job = await job_of(operators, claimed.job.id)
    assert (job.completed_by, job.response) == (1, RESPONSE)
    assert states(job) == [AttemptState.SUCCEEDED, AttemptState.DISCARDED]


async def test_attempts_completing_in_reverse_order(hot: JobStore, operators: Operators) -> None:
    # The seed's race: attempt 2 finishes first and wins; attempt 1's late result is discarded.
    claimed = await claim(hot)
    assert await hot.add_attempt(claimed.job, "fallback", lease=LEASE) == 2
    assert (await job_of(operators, claimed.job.id)).version == claimed.job.version
    assert await hot.complete(claimed.job, 2, RESPONSE, ttl=TTL)
    assert not await hot.complete(claimed.job, 1, LATE_RESPONSE, ttl=TTL)
    job = await job_of(operators, claimed.job.id)
    assert (job.state, job.completed_by, job.response) == (JobState.COMPLETED, 2, RESPONSE)
    assert states(job) == [AttemptState.DISCARDED, AttemptState.SUCCEEDED]
    assert [a.upstream for a in job.attempts] == ["primary", "fallback"]


async def test_add_attempt_needs_the_current_in_flight_version(
    hot: JobStore, operators: Operators
) -> None:
    claimed = await claim(hot)
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    assert await hot.add_attempt(claimed.job, "fallback", lease=LEASE) is None
    job = await job_of(operators, claimed.job.id)
    assert await hot.add_attempt(job, "fallback", lease=LEASE) is None  # completed
    assert (job.attempt_count, len(job.attempts)) == (1, 1)


# --- settle -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "attempt_state"),
    [(JobState.RELEASED, AttemptState.FAILED), (JobState.UNKNOWN, AttemptState.UNKNOWN)],
    ids=["released", "unknown"],
)
async def test_settle(
    hot: JobStore, operators: Operators, state: JobState, attempt_state: AttemptState
) -> None:
    claimed = await claim(hot)
    assert await hot.settle(claimed.job, 1, state, status=503, error="upstream said 503")
    job = await job_of(operators, claimed.job.id)
    assert (job.state, job.version, job.response) == (state, claimed.job.version + 1, None)
    [attempt] = job.attempts
    assert (attempt.state, attempt.status, attempt.error) == (
        attempt_state,
        503,
        "upstream said 503",
    )
    assert attempt.finished_at is not None


async def test_settle_with_a_stale_version_loses(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    assert await hot.settle(claimed.job, 1, JobState.RELEASED, status=503)
    assert not await hot.settle(claimed.job, 1, JobState.UNKNOWN, error="timeout")
    job = await job_of(operators, claimed.job.id)
    assert (job.state, job.version) == (JobState.RELEASED, claimed.job.version + 1)
    [attempt] = job.attempts
    assert (attempt.state, attempt.status, attempt.error) == (AttemptState.FAILED, 503, None)


async def test_settle_cannot_undo_a_completion(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    assert not await hot.settle(claimed.job, 1, JobState.UNKNOWN, error="timeout")
    job = await job_of(operators, claimed.job.id)
    assert (job.state, job.response) == (JobState.COMPLETED, RESPONSE)


@pytest.mark.parametrize("state", [JobState.COMPLETED, JobState.IN_FLIGHT])
async def test_settle_only_releases_or_marks_unknown(hot: JobStore, state: JobState) -> None:
    claimed = await claim(hot)
    with pytest.raises(ValueError, match="settle cannot"):
        await hot.settle(claimed.job, 1, state)


# --- start_next_attempt -----------------------------------------------------------------------


async def test_one_of_many_retries_starts_the_next_attempt(
    hot: JobStore, operators: Operators
) -> None:
    job = await settled(hot, operators, JobState.RELEASED)
    results = await asyncio.gather(
        *(hot.start_next_attempt(job, "fallback", lease=LEASE) for _ in range(10))
    )
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    started = winners[0]
    assert started.attempt == 2
    assert (started.job.state, started.job.attempt_count) == (JobState.IN_FLIGHT, 2)
    assert started.job.version == job.version + 1
    after = await job_of(operators, job.id)
    assert states(after) == [AttemptState.FAILED, AttemptState.STARTED]
    assert after.attempts[1].upstream == "fallback"
    assert await hot.complete(started.job, 2, RESPONSE, ttl=TTL)


async def test_no_next_attempt_for_an_unknown_job(hot: JobStore, operators: Operators) -> None:
    job = await settled(hot, operators, JobState.UNKNOWN)
    assert await hot.start_next_attempt(job, "fallback", lease=LEASE) is None
    assert (await job_of(operators, job.id)).attempt_count == 1


async def test_no_next_attempt_for_a_completed_job(hot: JobStore, operators: Operators) -> None:
    job = await completed(hot, operators)
    assert await hot.start_next_attempt(job, "fallback", lease=LEASE) is None
    assert (await job_of(operators, job.id)).state is JobState.COMPLETED


async def test_no_next_attempt_for_a_job_in_flight(hot: JobStore) -> None:
    claimed = await claim(hot)
    assert await hot.start_next_attempt(claimed.job, "fallback", lease=LEASE) is None


# --- expiry -----------------------------------------------------------------------------------


async def test_forget_deletes_an_expired_completed_job(hot: JobStore, operators: Operators) -> None:
    job = await completed(hot, operators, ttl=0)
    assert job.expired
    assert await hot.forget(job)
    assert await operators.get_by_id(job.id) is None
    await claim(hot)  # the key is free again


async def test_forget_deletes_an_expired_released_job(hot: JobStore, operators: Operators) -> None:
    job = await settled(hot, operators, JobState.RELEASED, ttl=0)
    assert job.expired
    assert await hot.forget(job)
    assert await operators.get_by_id(job.id) is None


async def test_forget_keeps_a_job_that_has_not_expired(hot: JobStore, operators: Operators) -> None:
    job = await completed(hot, operators)
    assert not job.expired
    assert not await hot.forget(job)
    assert await operators.get_by_id(job.id) is not None


async def test_forget_never_deletes_in_flight_or_unknown_jobs(
    hot: JobStore, operators: Operators
) -> None:
    in_flight = await job_of(operators, (await claim(hot, "k1", ttl=0)).job.id)
    unknown = await settled(hot, operators, JobState.UNKNOWN, key="k2", ttl=0)
    for job in (in_flight, unknown):
        assert job.expired
        assert not await hot.forget(job)
        assert await operators.get_by_id(job.id) is not None


async def test_forget_with_a_stale_version_loses(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot, ttl=0)
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=0)
    assert not await hot.forget(claimed.job)
    assert await operators.get_by_id(claimed.job.id) is not None


# --- watching ---------------------------------------------------------------------------------


async def test_complete_wakes_watchers_of_that_job_only(hot: JobStore) -> None:
    await wait_until_listening(hot)
    claimed, other = await claim(hot, "k1"), await claim(hot, "k2")
    async with hot.watching(claimed.job.id) as sub, hot.watching(other.job.id) as idle:
        await hot.watch_job(claimed.job.owner, claimed.job.key)
        await hot.watch_job(other.job.owner, other.job.key)
        assert not await sub.wait(QUIET)
        assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
        assert await sub.wait(WAKE_TIMEOUT)
        assert not await idle.wait(QUIET)


@pytest.mark.parametrize("state", [JobState.RELEASED, JobState.UNKNOWN])
async def test_settle_wakes_watchers(hot: JobStore, state: JobState) -> None:
    await wait_until_listening(hot)
    claimed = await claim(hot)
    async with hot.watching(claimed.job.id) as sub:
        await hot.watch_job(claimed.job.owner, claimed.job.key)
        assert await hot.settle(claimed.job, 1, state)
        assert await sub.wait(WAKE_TIMEOUT)


async def test_a_second_replica_is_woken_through_notify(replicated_dsn: str) -> None:
    async with open_store(replicated_dsn) as first, open_store(replicated_dsn) as second:
        await wait_until_listening(second)
        claimed = await claim(first)
        async with second.watching(claimed.job.id) as sub:
            watched = await second.watch_job(claimed.job.owner, claimed.job.key)
            assert watched is not None and watched.state is JobState.IN_FLIGHT
            assert not await sub.wait(QUIET)
            assert await first.complete(claimed.job, 1, RESPONSE, ttl=TTL)
            assert await sub.wait(WAKE_TIMEOUT)
        assert (await job_of(second, claimed.job.id)).response == RESPONSE


async def test_watch_job_of_a_finished_job_returns_it_as_it_is(hot: JobStore) -> None:
    claimed = await claim(hot)
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    watched = await hot.watch_job(claimed.job.owner, claimed.job.key)
    assert watched is not None and watched.state is JobState.COMPLETED
    assert await hot.watch_job(claimed.job.owner, "no-such-key") is None


async def test_changes_of_unwatched_jobs_cost_no_notification(replicated_dsn: str) -> None:
    """SPEC §2.3 + performance: NOTIFY is serialised server-wide; only held duplicates pay it."""
    async with open_store(replicated_dsn) as first, open_store(replicated_dsn) as second:
        await wait_until_listening(second)
        claimed = await claim(first)
        async with second.watching(claimed.job.id) as sub:  # subscribed, but never announced
            assert await first.complete(claimed.job, 1, RESPONSE, ttl=TTL)
            assert not await sub.wait(QUIET * 4)


async def allow_connections(admin: asyncpg.Connection, database: str, *, allow: bool) -> None:
    await admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS {str(allow).lower()}')


async def end_connections(admin: asyncpg.Connection, database: str) -> None:
    """Terminate every session on `database`, waiting (up to 5 s each) until they are gone."""
    await admin.execute(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = $1",
        database,
    )
