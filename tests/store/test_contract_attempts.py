"""The store contract for leases, takeover, fail-over, hedging and operator resolution
(SPEC §3.2-§3.5): every test runs against SQLite and PostgreSQL alike.

Lease tests use leases of a fraction of a second: every lease time comes from the database
clock, so they only sleep past it, never compare it with the test's own clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from idemproxy.core.decision import Policy, Replay, TakeOver, decide
from idemproxy.core.types import (
    AttemptState,
    Claimed,
    Existing,
    Intent,
    Job,
    JobState,
    StoredResponse,
)
from idemproxy.store.base import AttemptFailure, Store
from idemproxy.store.factory import create_store
from idemproxy.store.watch import JobWatch

TTL = 3600.0
LEASE = 30.0  # never runs out during a test
SHORT = 0.2  # runs out quickly
PAST_SHORT = 0.35  # sleeping this long lets a SHORT lease run out
WAKE_TIMEOUT = 5.0  # an upper bound: a woken subscriber returns at once
QUIET = 0.05

RESPONSE = StoredResponse(
    201, (("Content-Type", "application/json"), ("Location", "/charges/7")), b'{"id": 7}'
)
LATE = StoredResponse(200, (("X-Late", "yes"),), b"late")
OPERATOR = StoredResponse(200, (("Content-Type", "text/plain"),), b"settled by hand \x00\xff")


def intent(key: str = "k1", owner: str = "alice") -> Intent:
    return Intent(owner=owner, key=key, fingerprint="fp1", method="POST", path="/charges")


async def claim(
    store: Store, key: str = "k1", *, owner: str = "alice", lease: float = LEASE
) -> Claimed:
    result = await store.claim(
        intent(key, owner), str(uuid.uuid4()), "primary", ttl=TTL, lease=lease
    )
    assert isinstance(result, Claimed)
    return result


async def job_of(store: Store, job_id: str) -> Job:
    job = await store.get_by_id(job_id)
    assert job is not None
    return job


async def current(store: Store, job: Job) -> Job:
    found = await store.get(job.owner, job.key)
    assert found is not None
    return found


async def unknown_job(store: Store, key: str = "k1") -> Job:
    """A job whose only attempt timed out: `unknown`, waiting for an operator."""
    claimed = await claim(store, key)
    assert await store.settle(claimed.job, 1, JobState.UNKNOWN, error="timeout")
    return await job_of(store, claimed.job.id)


async def expired_lease(store: Store, key: str = "k1") -> Job:
    """A job in flight whose proxy stopped renewing: its lease ran out by the database clock."""
    claimed = await claim(store, key, lease=0.05)
    await asyncio.sleep(0.2)
    job = await current(store, claimed.job)
    assert job.lease_expired
    return job


def attempts(job: Job) -> list[tuple[int, AttemptState, int | None, str | None]]:
    return [(a.number, a.state, a.status, a.error) for a in job.attempts]


@contextlib.asynccontextmanager
async def open_store(dsn: str) -> AsyncIterator[Store]:
    store = create_store(dsn)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def wait_until_listening(store: Store) -> None:
    """PostgreSQL starts LISTEN in the background: once a probe job's wake-up arrives, it is up."""
    probe = await claim(store, key=f"feed-probe-{uuid.uuid4()}")
    async with store.watching(probe.job.id) as sub:
        await store.watch_job(probe.job.owner, probe.job.key)
        assert await store.complete(probe.job, 1, RESPONSE, ttl=TTL)
        assert await sub.wait(WAKE_TIMEOUT)


@contextlib.asynccontextmanager
async def held(store: Store, job: Job) -> AsyncIterator[JobWatch.Subscription]:
    """Subscribe the way a held duplicate does (`Governor._hold`, proxy/jobs/governed.py):
    subscribe, then mark."""
    await wait_until_listening(store)
    async with store.watching(job.id) as sub:
        await store.watch_job(job.owner, job.key)
        assert not await sub.wait(QUIET)
        yield sub


# --- the lease and its renewal (SPEC §3.5) ------------------------------------------------------


async def test_a_lease_that_is_not_renewed_expires(store: Store) -> None:
    claimed = await claim(store, lease=SHORT)
    assert not claimed.job.lease_expired
    assert not (await current(store, claimed.job)).lease_expired
    await asyncio.sleep(PAST_SHORT)
    job = await current(store, claimed.job)
    assert (job.state, job.lease_expired, job.version) == (
        JobState.IN_FLIGHT,
        True,
        claimed.job.version,
    )
    # Every way of reading the job tells the same: the proxy decides from any of them.
    assert (await job_of(store, job.id)).lease_expired
    [listed] = await store.list_jobs()
    assert listed.lease_expired
    again = await store.claim(intent(), str(uuid.uuid4()), "primary", ttl=TTL, lease=SHORT)
    assert isinstance(again, Existing) and again.job.lease_expired
    watched = await store.watch_job(job.owner, job.key)
    assert watched is not None and watched.lease_expired
    assert decide(job, "fp1", Policy()) == TakeOver(job.version)


async def test_renewing_keeps_the_lease_alive(store: Store) -> None:
    claimed = await claim(store, lease=SHORT)
    for _ in range(8):  # about 0.5 s, well past the original lease
        await asyncio.sleep(SHORT / 3)
        assert await store.renew_lease(claimed.job, lease=SHORT)
        assert not (await current(store, claimed.job)).lease_expired
    job = await job_of(store, claimed.job.id)
    # A renewal is not a state change: the version (the CAS token) stays the same.
    assert (job.state, job.version) == (JobState.IN_FLIGHT, claimed.job.version)
    assert attempts(job) == [(1, AttemptState.STARTED, None, None)]
    await asyncio.sleep(PAST_SHORT)  # and once renewals stop, it runs out
    assert (await current(store, claimed.job)).lease_expired
    assert await store.complete(claimed.job, 1, RESPONSE, ttl=TTL)


async def test_renewing_an_expired_lease_revives_it_before_any_takeover(store: Store) -> None:
    # A proxy stalled past its lease but nobody took the job over: it is still its job.
    job = await expired_lease(store)
    assert await store.renew_lease(job, lease=LEASE)
    renewed = await current(store, job)
    assert not renewed.lease_expired
    assert not await store.take_over(renewed)


async def test_renewing_a_job_that_is_no_longer_in_flight_fails(store: Store) -> None:
    done = await claim(store, "done")
    assert await store.complete(done.job, 1, RESPONSE, ttl=TTL)
    assert not await store.renew_lease(done.job, lease=LEASE)
    assert not await store.renew_lease(await current(store, done.job), lease=LEASE)

    unknown = await unknown_job(store, "unknown")
    assert not await store.renew_lease(unknown, lease=LEASE)

    released = await claim(store, "released")
    assert await store.settle(released.job, 1, JobState.RELEASED, status=503)
    assert not await store.renew_lease(await current(store, released.job), lease=LEASE)

    for job in (done.job, unknown, released.job):
        assert (await current(store, job)).lease_expired is False


async def test_renewing_with_a_stale_version_fails(store: Store) -> None:
    claimed = await claim(store)
    moved = await store.fail_over(
        claimed.job, 1, "fallback", failure=AttemptFailure(503, "busy"), lease=SHORT
    )
    assert moved is not None
    assert not await store.renew_lease(claimed.job, lease=LEASE)  # the old attempt's view
    assert await store.renew_lease(moved.job, lease=LEASE)


async def test_only_jobs_in_flight_can_have_an_expired_lease(store: Store) -> None:
    done = await claim(store, "done", lease=0.05)
    assert await store.complete(done.job, 1, RESPONSE, ttl=TTL)
    gone = await claim(store, "gone", lease=0.05)
    assert await store.settle(gone.job, 1, JobState.RELEASED, status=503)
    await asyncio.sleep(0.2)
    for job in (done.job, gone.job):
        assert not (await current(store, job)).lease_expired
        assert not await store.take_over(await current(store, job))


# --- take_over (SPEC §3.5) --------------------------------------------------------------------


async def test_take_over_marks_the_job_and_its_running_attempts_unknown(store: Store) -> None:
    claimed = await claim(store, lease=0.05)
    assert await store.add_attempt(claimed.job, "hedge", lease=0.05) == 2
    assert await store.add_attempt(claimed.job, "third", lease=0.05) == 3
    await store.finish_attempt(claimed.job, 3, JobState.RELEASED, status=503, error="busy")
    await asyncio.sleep(0.2)
    job = await current(store, claimed.job)
    assert job.lease_expired

    assert await store.take_over(job)

    after = await job_of(store, job.id)
    assert (after.state, after.version, after.lease_expired) == (
        JobState.UNKNOWN,
        job.version + 1,
        False,
    )
    assert (after.response, after.completed_by) == (None, None)
    assert attempts(after) == [
        (1, AttemptState.UNKNOWN, None, "lease expired"),
        (2, AttemptState.UNKNOWN, None, "lease expired"),
        (3, AttemptState.FAILED, 503, "busy"),  # it had finished: its outcome is kept
    ]
    assert all(a.finished_at is not None for a in after.attempts)
    assert after.updated_at is not None and after.created_at is not None
    assert after.updated_at >= after.created_at
    # From now on every retry is told the outcome is unknown (SPEC §2.3).
    assert await store.count_unknown() == 1
    assert not await store.take_over(job)  # and it happens once
    assert not await store.take_over(after)


async def test_take_over_loses_while_the_lease_is_live(store: Store) -> None:
    claimed = await claim(store)
    assert not await store.take_over(claimed.job)
    # The database clock decides, not the caller's belief that the lease ran out.
    assert not await store.take_over(claimed.job._replace(lease_expired=True))
    job = await job_of(store, claimed.job.id)
    assert (job.state, job.version) == (JobState.IN_FLIGHT, claimed.job.version)
    assert attempts(job) == [(1, AttemptState.STARTED, None, None)]


async def test_take_over_with_a_stale_version_loses(store: Store) -> None:
    claimed = await claim(store, lease=0.05)
    moved = await store.fail_over(
        claimed.job, 1, "fallback", failure=AttemptFailure(None, "refused"), lease=0.05
    )
    assert moved is not None
    await asyncio.sleep(0.2)
    assert not await store.take_over(claimed.job)
    assert (await current(store, claimed.job)).state is JobState.IN_FLIGHT
    assert await store.take_over(moved.job)
    after = await job_of(store, claimed.job.id)
    assert attempts(after) == [
        (1, AttemptState.FAILED, None, "refused"),
        (2, AttemptState.UNKNOWN, None, "lease expired"),
    ]


async def test_one_of_many_concurrent_takeovers_wins(store: Store, store_dsn: str) -> None:
    job = await expired_lease(store)
    async with open_store(store_dsn) as replica:  # a second proxy on the same database
        results = await asyncio.gather(
            *(s.take_over(job) for _ in range(8) for s in (store, replica))
        )
    assert results.count(True) == 1, results
    after = await job_of(store, job.id)
    assert (after.state, after.version) == (JobState.UNKNOWN, job.version + 1)
    assert attempts(after) == [(1, AttemptState.UNKNOWN, None, "lease expired")]


async def test_take_over_wakes_held_duplicates(store: Store) -> None:
    claimed = await claim(store, lease=0.3)
    async with held(store, claimed.job) as sub:
        await asyncio.sleep(0.4)
        job = await current(store, claimed.job)
        assert job.lease_expired
        assert await store.take_over(job)
        assert await sub.wait(WAKE_TIMEOUT)


@pytest.mark.postgres
async def test_take_over_wakes_duplicates_held_by_another_replica(pg_dsn: str) -> None:
    async with open_store(pg_dsn) as first, open_store(pg_dsn) as second:
        claimed = await claim(first, lease=0.3)
        async with held(second, claimed.job) as sub:
            await asyncio.sleep(0.4)
            assert await first.take_over(await current(first, claimed.job))
            assert await sub.wait(WAKE_TIMEOUT)
        assert (await current(second, claimed.job)).state is JobState.UNKNOWN


async def test_a_late_completion_after_a_takeover_is_discarded(store: Store) -> None:
    # The proxy was only stalled, not dead: its result arrives after the takeover.
    claimed = await claim(store, lease=0.05)
    await asyncio.sleep(0.2)
    assert await store.take_over(await current(store, claimed.job))

    assert not await store.complete(claimed.job, 1, LATE, ttl=TTL)

    after = await job_of(store, claimed.job.id)
    assert (after.state, after.response, after.completed_by) == (JobState.UNKNOWN, None, None)
    [attempt] = after.attempts
    # The race is recorded (with the status the upstream gave), the result never stored.
    assert (attempt.state, attempt.status) == (AttemptState.DISCARDED, LATE.status)
    assert attempt.finished_at is not None
    # Even with the post-takeover version, an unknown job cannot be completed by an attempt.
    assert not await store.complete(after, 1, LATE, ttl=TTL)
    assert (await current(store, after)).state is JobState.UNKNOWN


async def test_a_late_release_after_a_takeover_cannot_release_the_job(store: Store) -> None:
    # The takeover said "may have executed": a late 503 must not let a retry run it again.
    claimed = await claim(store, lease=0.05)
    await asyncio.sleep(0.2)
    assert await store.take_over(await current(store, claimed.job))
    assert not await store.settle(claimed.job, 1, JobState.RELEASED, status=503)
    after = await job_of(store, claimed.job.id)
    assert after.state is JobState.UNKNOWN
    assert attempts(after) == [(1, AttemptState.UNKNOWN, None, "lease expired")]
    assert await store.start_next_attempt(after, "primary", lease=LEASE) is None


# --- fail_over and hedging (SPEC §3.4) --------------------------------------------------------


async def test_fail_over_starts_the_next_attempt_on_the_fallback(store: Store) -> None:
    claimed = await claim(store)
    moved = await store.fail_over(
        claimed.job, 1, "fallback", failure=AttemptFailure(503, "upstream said 503"), lease=LEASE
    )
    assert moved is not None
    assert moved.attempt == 2
    assert (moved.job.state, moved.job.attempt_count, moved.job.version) == (
        JobState.IN_FLIGHT,
        2,
        claimed.job.version + 1,
    )
    assert (moved.job.id, moved.job.lease_expired) == (claimed.job.id, False)
    job = await job_of(store, claimed.job.id)
    assert attempts(job) == [
        (1, AttemptState.FAILED, 503, "upstream said 503"),
        (2, AttemptState.STARTED, None, None),
    ]
    assert [a.upstream for a in job.attempts] == ["primary", "fallback"]
    assert job.attempts[0].finished_at is not None and job.attempts[1].finished_at is None

    assert await store.complete(moved.job, 2, RESPONSE, ttl=TTL)
    done = await job_of(store, claimed.job.id)
    assert (done.state, done.completed_by, done.response) == (JobState.COMPLETED, 2, RESPONSE)


async def test_fail_over_along_a_chain_of_fallbacks(store: Store) -> None:
    claimed = await claim(store)
    second = await store.fail_over(
        claimed.job, 1, "b", failure=AttemptFailure(None, "refused"), lease=LEASE
    )
    assert second is not None
    third = await store.fail_over(
        second.job, 2, "c", failure=AttemptFailure(429, None), lease=LEASE
    )
    assert third is not None and third.attempt == 3
    assert third.job.version == claimed.job.version + 2
    job = await job_of(store, claimed.job.id)
    assert attempts(job) == [
        (1, AttemptState.FAILED, None, "refused"),
        (2, AttemptState.FAILED, 429, None),
        (3, AttemptState.STARTED, None, None),
    ]
    assert [a.upstream for a in job.attempts] == ["primary", "b", "c"]


async def test_fail_over_with_a_stale_version_changes_nothing(store: Store) -> None:
    claimed = await claim(store)
    assert await store.fail_over(
        claimed.job, 1, "b", failure=AttemptFailure(503, None), lease=LEASE
    )
    assert (
        await store.fail_over(claimed.job, 1, "c", failure=AttemptFailure(503, None), lease=LEASE)
        is None
    )
    job = await job_of(store, claimed.job.id)
    assert (job.attempt_count, job.version) == (2, claimed.job.version + 1)
    assert [a.upstream for a in job.attempts] == ["primary", "b"]


@pytest.mark.parametrize("end", ["completed", "unknown", "released"])
async def test_no_fail_over_once_the_job_left_in_flight(store: Store, end: str) -> None:
    claimed = await claim(store)
    if end == "completed":
        assert await store.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    else:
        assert await store.settle(claimed.job, 1, JobState(end), status=503)
    job = await current(store, claimed.job)
    assert (
        await store.fail_over(job, 1, "b", failure=AttemptFailure(503, None), lease=LEASE) is None
    )
    after = await job_of(store, job.id)
    assert (after.state, after.version, after.attempt_count) == (job.state, job.version, 1)


async def test_of_concurrent_fail_overs_exactly_one_wins(store: Store) -> None:
    claimed = await claim(store)
    results = await asyncio.gather(
        *(
            store.fail_over(claimed.job, 1, f"f{i}", failure=AttemptFailure(503, None), lease=LEASE)
            for i in range(8)
        )
    )
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    job = await job_of(store, claimed.job.id)
    assert job.attempt_count == 2 and len(job.attempts) == 2


async def test_a_duplicate_counts_the_hedges_of_the_version_that_won(store: Store) -> None:
    """A late attempt of an older version ending (its CAS lost) must not make a replay cache
    forget the attempts hedged under the version in flight now (found by the model test)."""
    claimed = await claim(store)
    following = await store.fail_over(
        claimed.job, 1, "f1", failure=AttemptFailure(503, None), lease=LEASE
    )
    assert following is not None and following.attempt == 2
    assert await store.add_attempt(following.job, "hedge", lease=LEASE) == 3
    assert not await store.settle(claimed.job, 1, JobState.UNKNOWN, error="late timeout")
    assert not await store.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    assert await store.complete(following.job, 2, RESPONSE, ttl=TTL)

    duplicate = await store.claim(intent(), str(uuid.uuid4()), "primary", ttl=TTL, lease=LEASE)
    assert isinstance(duplicate, Existing)
    assert duplicate.job.attempt_count == 3
    assert (await job_of(store, claimed.job.id)).attempt_count == 3


async def test_finish_attempt_records_one_failure_and_leaves_the_job_alone(store: Store) -> None:
    claimed = await claim(store)
    assert await store.add_attempt(claimed.job, "hedge", lease=LEASE) == 2

    await store.finish_attempt(claimed.job, 1, JobState.RELEASED, status=503, error="busy")

    job = await job_of(store, claimed.job.id)
    assert (job.state, job.version, job.attempt_count, job.response) == (
        JobState.IN_FLIGHT,
        claimed.job.version,
        2,
        None,
    )
    assert attempts(job) == [
        (1, AttemptState.FAILED, 503, "busy"),
        (2, AttemptState.STARTED, None, None),
    ]
    assert job.attempts[0].finished_at is not None

    await store.finish_attempt(claimed.job, 2, JobState.UNKNOWN, error="timeout")
    job = await job_of(store, claimed.job.id)
    assert (job.state, job.version) == (JobState.IN_FLIGHT, claimed.job.version)
    assert attempts(job)[1] == (2, AttemptState.UNKNOWN, None, "timeout")


async def test_finish_attempt_never_rewrites_a_finished_attempt(store: Store) -> None:
    claimed = await claim(store)
    assert await store.add_attempt(claimed.job, "hedge", lease=LEASE) == 2
    assert await store.complete(claimed.job, 2, RESPONSE, ttl=TTL)
    await store.finish_attempt(claimed.job, 2, JobState.UNKNOWN, error="late timeout")
    await store.finish_attempt(claimed.job, 1, JobState.RELEASED, status=503, error="busy")
    job = await job_of(store, claimed.job.id)
    assert (job.state, job.completed_by, job.response) == (JobState.COMPLETED, 2, RESPONSE)
    assert attempts(job) == [
        (1, AttemptState.FAILED, 503, "busy"),
        (2, AttemptState.SUCCEEDED, 201, None),
    ]


async def test_a_hedged_attempt_shares_the_version_and_extends_the_lease(store: Store) -> None:
    claimed = await claim(store, lease=0.4)
    await asyncio.sleep(0.2)
    assert await store.add_attempt(claimed.job, "hedge", lease=0.4) == 2
    await asyncio.sleep(0.3)  # past the first lease (0.4 s), not the hedge's (0.6 s)
    job = await current(store, claimed.job)
    assert (job.version, job.lease_expired) == (claimed.job.version, False)
    # Renewal covers every running attempt of the job.
    assert await store.renew_lease(job, lease=LEASE)
    assert not (await current(store, job)).lease_expired


# --- resolve (SPEC §3.3) ----------------------------------------------------------------------


async def test_resolve_as_completed_stores_a_response_to_replay(store: Store) -> None:
    job = await unknown_job(store)
    assert await store.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL)

    found = await current(store, job)
    assert (found.state, found.version, found.resolution, found.completed_by) == (
        JobState.COMPLETED,
        job.version + 1,
        "operator",
        0,
    )
    assert found.response == OPERATOR
    assert found.expires_at is not None and found.updated_at is not None
    assert abs(found.expires_at - found.updated_at - timedelta(seconds=TTL)) < timedelta(seconds=1)
    assert not found.expired
    # A retry of the intent now gets the operator's response (SPEC §7).
    assert decide(found, "fp1", Policy()) == Replay(OPERATOR)
    again = await store.claim(intent(), str(uuid.uuid4()), "primary", ttl=TTL, lease=LEASE)
    assert isinstance(again, Existing) and again.job.response == OPERATOR
    # The attempt history is not rewritten: it really did end unknown.
    assert attempts(await job_of(store, job.id)) == [(1, AttemptState.UNKNOWN, None, "timeout")]
    assert await store.count_unknown() == 0


async def test_resolve_as_released_lets_the_next_retry_run(store: Store) -> None:
    job = await unknown_job(store)
    assert await store.resolve(job, JobState.RELEASED, resolution="unknown_ttl")

    found = await current(store, job)
    assert (found.state, found.version, found.resolution, found.response) == (
        JobState.RELEASED,
        job.version + 1,
        "unknown_ttl",
        None,
    )
    started = await store.start_next_attempt(found, "primary", lease=LEASE)
    assert started is not None and started.attempt == 2
    assert await store.complete(started.job, 2, RESPONSE, ttl=TTL)
    done = await job_of(store, job.id)
    assert (done.state, done.completed_by) == (JobState.COMPLETED, 2)
    assert [a.state for a in done.attempts] == [AttemptState.UNKNOWN, AttemptState.SUCCEEDED]


async def test_resolve_a_job_that_was_taken_over(store: Store) -> None:
    job = await expired_lease(store)
    assert await store.take_over(job)
    taken = await current(store, job)
    assert await store.resolve(taken, JobState.COMPLETED, response=OPERATOR, ttl=TTL)
    assert (await current(store, job)).response == OPERATOR


@pytest.mark.parametrize("state", [JobState.COMPLETED, JobState.RELEASED])
async def test_resolve_only_settles_unknown_jobs(store: Store, state: JobState) -> None:
    in_flight = (await claim(store, "in-flight")).job
    done = await claim(store, "done")
    assert await store.complete(done.job, 1, RESPONSE, ttl=TTL)
    released = await claim(store, "released")
    assert await store.settle(released.job, 1, JobState.RELEASED, status=503)
    for job in (in_flight, await current(store, done.job), await current(store, released.job)):
        assert not await store.resolve(job, state, response=OPERATOR, ttl=TTL)
        after = await current(store, job)
        assert (after.state, after.version, after.resolution) == (job.state, job.version, None)
    assert (await current(store, done.job)).response == RESPONSE


async def test_resolve_with_a_stale_version_loses(store: Store) -> None:
    job = await unknown_job(store)
    assert await store.resolve(job, JobState.RELEASED)
    assert not await store.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL)
    assert not await store.resolve(job, JobState.RELEASED)
    after = await current(store, job)
    assert (after.state, after.version, after.response) == (
        JobState.RELEASED,
        job.version + 1,
        None,
    )


async def test_of_two_concurrent_resolutions_exactly_one_wins(store: Store, store_dsn: str) -> None:
    job = await unknown_job(store)
    async with open_store(store_dsn) as other_operator:
        results = await asyncio.gather(
            store.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL),
            other_operator.resolve(job, JobState.RELEASED),
            store.resolve(job, JobState.RELEASED),
            other_operator.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL),
        )
    assert results.count(True) == 1, results
    after = await current(store, job)
    assert after.version == job.version + 1
    winner = results.index(True)
    if winner in (0, 3):
        assert (after.state, after.response) == (JobState.COMPLETED, OPERATOR)
    else:
        assert (after.state, after.response) == (JobState.RELEASED, None)


@pytest.mark.parametrize("response", [None, StoredResponse(200, (), None)], ids=["none", "omitted"])
async def test_resolve_as_completed_needs_a_body(
    store: Store, response: StoredResponse | None
) -> None:
    job = await unknown_job(store)
    with pytest.raises(ValueError, match="needs a response"):
        await store.resolve(job, JobState.COMPLETED, response=response)
    with pytest.raises(ValueError):
        await store.resolve(job, JobState.IN_FLIGHT)
    assert (await current(store, job)).state is JobState.UNKNOWN


@pytest.mark.parametrize("state", [JobState.COMPLETED, JobState.RELEASED])
async def test_resolve_wakes_waiters(store: Store, state: JobState) -> None:
    job = await unknown_job(store)
    await wait_until_listening(store)
    async with store.watching(job.id) as sub:
        assert await store.resolve(job, state, response=OPERATOR, ttl=TTL)
        assert await sub.wait(WAKE_TIMEOUT)


# --- delete, stale_unknown, count_unknown (SPEC §3.3, §13) ------------------------------------


async def test_delete_removes_the_job_and_its_attempts(store: Store) -> None:
    job = await unknown_job(store)
    assert await store.delete(job)
    assert await store.get_by_id(job.id) is None
    assert await store.get(job.owner, job.key) is None
    assert not await store.delete(job)
    # The key is free again: a new job with a fresh first attempt.
    fresh = await claim(store)
    assert fresh.job.id != job.id
    assert attempts(await job_of(store, fresh.job.id)) == [(1, AttemptState.STARTED, None, None)]


async def test_delete_is_a_cas_on_the_version_and_names_the_owner(store: Store) -> None:
    alice = await unknown_job(store)
    bob = await claim(store, owner="bob")
    assert not await store.delete(alice._replace(owner="bob"))  # bob's key, alice's id
    assert not await store.delete(alice._replace(version=alice.version - 1))  # changed since
    assert not await store.delete(alice._replace(version=alice.version + 7), force=True)
    assert await store.get_by_id(alice.id) is not None
    assert await store.delete(alice)
    assert await store.get_by_id(alice.id) is None
    assert await store.get_by_id(bob.job.id) is not None


async def test_delete_refuses_a_job_in_flight_with_a_live_lease_unless_forced(
    store: Store,
) -> None:
    running = await claim(store)
    assert not await store.delete(running.job)
    assert await store.get_by_id(running.job.id) is not None
    assert await store.delete(running.job, force=True)
    assert await store.get_by_id(running.job.id) is None
    # Its lease ran out by the database clock (its proxy died): no force needed.
    dead = await expired_lease(store, "k2")
    assert await store.delete(dead)


async def test_delete_of_a_released_job_a_retry_restarted_loses(store: Store) -> None:
    claimed = await claim(store)
    assert await store.settle(claimed.job, 1, JobState.RELEASED, status=503)
    read = await current(store, claimed.job)  # what an operator saw: released
    assert await store.start_next_attempt(read, "primary", lease=LEASE) is not None
    assert not await store.delete(read)
    assert not await store.delete(read, force=True)
    assert (await current(store, read)).state is JobState.IN_FLIGHT


async def test_delete_wakes_waiters(store: Store) -> None:
    claimed = await claim(store)
    async with held(store, claimed.job) as sub:
        assert await store.delete(claimed.job, force=True)
        assert await sub.wait(WAKE_TIMEOUT)


async def test_stale_unknown_lists_old_unknown_jobs_oldest_first(store: Store) -> None:
    # "young" must stay younger than `stale_after` through the checks below, which on a loaded
    # machine (a Citus cluster's multi-shard reads included) take a good part of a second.
    stale_after, aged = 1.5, 1.8
    old = []
    for i in range(3):
        old.append(await unknown_job(store, f"old-{i}"))
        await asyncio.sleep(0.01)  # distinct updated_at, even at SQLite's millisecond clock
    assert all(job.updated_at is not None for job in old)
    done = await claim(store, "done")
    assert await store.complete(done.job, 1, RESPONSE, ttl=TTL)
    await claim(store, "in-flight")
    released = await claim(store, "released")
    assert await store.settle(released.job, 1, JobState.RELEASED, status=503)
    resolved = await unknown_job(store, "resolved")
    assert await store.resolve(resolved, JobState.RELEASED)
    await asyncio.sleep(aged)
    young = await unknown_job(store, "young")

    stale = await store.stale_unknown(stale_after, 10)
    assert [job.id for job in stale] == [job.id for job in old]
    assert all(job.state is JobState.UNKNOWN for job in stale)
    first_two = await store.stale_unknown(stale_after, 2)
    assert [job.id for job in first_two] == [job.id for job in old[:2]]
    assert young.id in {job.id for job in await store.stale_unknown(0, 10)}
    assert await store.stale_unknown(60, 10) == []

    # A job becomes stale when it last changed, not when it was created.
    assert await store.stale_unknown(stale_after, 10) == stale
    settled_late = await claim(store, "settled-late")
    await asyncio.sleep(aged)
    assert await store.settle(settled_late.job, 1, JobState.UNKNOWN, error="timeout")
    assert settled_late.job.id not in {job.id for job in await store.stale_unknown(stale_after, 10)}


async def test_stale_unknown_jobs_can_be_released_by_their_version(store: Store) -> None:
    # What unknown_ttl does with them: resolve by CAS on the version it listed.
    job = await unknown_job(store)
    await asyncio.sleep(0.1)
    [stale] = await store.stale_unknown(0.05, 10)
    assert stale.version == job.version
    assert await store.resolve(stale, JobState.RELEASED, resolution="unknown_ttl")
    assert await store.stale_unknown(0, 10) == []


async def test_count_unknown(store: Store) -> None:
    assert await store.count_unknown() == 0
    first = await unknown_job(store, "a")
    second = await unknown_job(store, "b")
    done = await claim(store, "c")
    assert await store.complete(done.job, 1, RESPONSE, ttl=TTL)
    await claim(store, "d")
    stalled = await expired_lease(store, "e")  # in flight with an expired lease: not unknown yet
    assert await store.count_unknown() == 2
    assert await store.take_over(stalled)
    assert await store.count_unknown() == 3
    assert await store.resolve(first, JobState.RELEASED)
    assert await store.delete(second)
    assert await store.count_unknown() == 1


# --- expired_leases: the background takeover (SPEC §3.5) ---------------------------------------


async def test_expired_leases_lists_jobs_in_flight_whose_lease_ran_out_long_enough_ago(
    store: Store,
) -> None:
    first = await expired_lease(store, "dead-1")
    second = await expired_lease(store, "dead-2")
    await claim(store, "alive")  # a live lease
    done = await claim(store, "done", lease=0.05)
    assert await store.complete(done.job, 1, RESPONSE, ttl=TTL)
    await unknown_job(store, "unknown")

    found = await store.expired_leases(0.0, 10)
    assert [job.id for job in found] == [first.id, second.id]  # the oldest lease first
    assert all(job.state is JobState.IN_FLIGHT and job.lease_expired for job in found)
    assert [job.id for job in await store.expired_leases(0.0, 1)] == [first.id]
    # Not yet one `older_than` past the lease's end, by the database clock.
    assert await store.expired_leases(60.0, 10) == []

    # What the background pass does with each: the request's own takeover CAS.
    assert await store.take_over(found[0])
    assert not await store.take_over(found[0])
    taken = await job_of(store, first.id)
    assert taken.state is JobState.UNKNOWN
    assert attempts(taken) == [(1, AttemptState.UNKNOWN, None, "lease expired")]
    assert [job.id for job in await store.expired_leases(0.0, 10)] == [second.id]
    # A lease renewed meanwhile (a live proxy that was only late) is not taken over.
    assert await store.renew_lease(found[1], lease=LEASE)
    assert not await store.take_over(found[1])
    assert await store.expired_leases(0.0, 10) == []


# --- late responses kept for the operator (SPEC §3.3) ------------------------------------------


async def test_a_late_response_after_a_takeover_is_kept_on_its_attempt(store: Store) -> None:
    job = await expired_lease(store)
    assert await store.take_over(job)
    assert not await store.complete(job, 1, LATE, ttl=TTL)
    taken = await job_of(store, job.id)
    assert taken.state is JobState.UNKNOWN
    assert attempts(taken) == [(1, AttemptState.DISCARDED, 200, "lease expired")]
    assert taken.attempts[0].late_bytes == len(LATE.body or b"")
    assert await store.late_response(taken, 1) == LATE
    assert await store.late_response(taken, 2) is None
    # Resolved with it: the job replays what the upstream really answered.
    kept = await store.late_response(taken, 1)
    assert await store.resolve(taken, JobState.COMPLETED, response=kept, ttl=TTL)
    assert (await current(store, taken)).response == LATE


async def test_a_hedging_losers_response_is_not_kept(store: Store) -> None:
    claimed = await claim(store)
    second = await store.add_attempt(claimed.job, "fallback", lease=LEASE)
    assert second == 2
    assert await store.complete(claimed.job, 2, RESPONSE, ttl=TTL)
    assert not await store.complete(claimed.job, 1, LATE, ttl=TTL)  # the job is completed
    done = await job_of(store, claimed.job.id)
    assert [a.late_bytes for a in done.attempts] == [None, None]
    assert await store.late_response(done, 1) is None


async def test_kept_late_responses_are_bounded_per_job(store_dsn: str) -> None:
    small = create_store(store_dsn, late_bytes=10)
    await small.open()
    try:
        await small.migrate()
        job = await expired_lease(small)
        number = await small.add_attempt(job, "fallback", lease=0.05)
        assert number == 2
        await asyncio.sleep(0.2)
        assert await small.take_over(await current(small, job))
        big = StoredResponse(200, (), b"x" * 11)
        six = StoredResponse(200, (), b"y" * 6)
        assert not await small.complete(job, 1, big, ttl=TTL)  # over the bound: not kept
        assert not await small.complete(job, 2, six, ttl=TTL)
        after = await job_of(small, job.id)
        assert [a.late_bytes for a in after.attempts] == [None, 6]
        omitted = await expired_lease(small, "k2")
        assert await small.take_over(omitted)
        assert not await small.complete(omitted, 1, StoredResponse(200, (), None), ttl=TTL)
        assert (await job_of(small, omitted.id)).attempts[0].late_bytes is None
    finally:
        await small.close()
