"""The store contract of the hot path's leases, takeover, fail-over and hedging (SPEC §3.2-§3.5),
on every store of tests/store/conftest.py; the operators' resolution and deletion are in
test_contract_operators.py.

Lease tests use leases of a fraction of a second: every lease time comes from the database
clock, so they only sleep past it, never compare it with the test's own clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest

from idemproxy.core.decision import Policy, TakeOver, decide
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
from idemproxy.store.ports import JobStore, Operators
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
    hot: JobStore, key: str = "k1", *, owner: str = "alice", lease: float = LEASE
) -> Claimed:
    result = await hot.claim(intent(key, owner), str(uuid.uuid4()), "primary", ttl=TTL, lease=lease)
    assert isinstance(result, Claimed)
    return result


async def job_of(operators: Operators, job_id: str) -> Job:
    job = await operators.get_by_id(job_id)
    assert job is not None
    return job


async def current(hot: JobStore, job: Job) -> Job:
    found = await hot.get(job.owner, job.key)
    assert found is not None
    return found


async def unknown_job(hot: JobStore, operators: Operators, key: str = "k1") -> Job:
    """A job whose only attempt timed out: `unknown`, waiting for an operator."""
    claimed = await claim(hot, key)
    assert await hot.settle(claimed.job, 1, JobState.UNKNOWN, error="timeout")
    return await job_of(operators, claimed.job.id)


async def expired_lease(hot: JobStore, key: str = "k1") -> Job:
    """A job in flight whose proxy stopped renewing: its lease ran out by the database clock."""
    claimed = await claim(hot, key, lease=0.05)
    await asyncio.sleep(0.2)
    job = await current(hot, claimed.job)
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


async def wait_until_listening(hot: JobStore) -> None:
    """PostgreSQL starts LISTEN in the background: once a probe job's wake-up arrives, it is up."""
    probe = await claim(hot, key=f"feed-probe-{uuid.uuid4()}")
    async with hot.watching(probe.job.id) as sub:
        await hot.watch_job(probe.job.owner, probe.job.key)
        assert await hot.complete(probe.job, 1, RESPONSE, ttl=TTL)
        assert await sub.wait(WAKE_TIMEOUT)


@contextlib.asynccontextmanager
async def held(hot: JobStore, job: Job) -> AsyncIterator[JobWatch.Subscription]:
    """Subscribe the way a held duplicate does (`Governor._hold`, proxy/jobs/governed.py):
    subscribe, then mark."""
    await wait_until_listening(hot)
    async with hot.watching(job.id) as sub:
        await hot.watch_job(job.owner, job.key)
        assert not await sub.wait(QUIET)
        yield sub


# --- the lease and its renewal (SPEC §3.5) ------------------------------------------------------


async def test_a_lease_that_is_not_renewed_expires(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot, lease=SHORT)
    assert not claimed.job.lease_expired
    assert not (await current(hot, claimed.job)).lease_expired
    await asyncio.sleep(PAST_SHORT)
    job = await current(hot, claimed.job)
    assert (job.state, job.lease_expired, job.version) == (
        JobState.IN_FLIGHT,
        True,
        claimed.job.version,
    )
    # Every way of reading the job tells the same: the proxy decides from any of them.
    assert (await job_of(operators, job.id)).lease_expired
    [listed] = await operators.list_jobs()
    assert listed.lease_expired
    again = await hot.claim(intent(), str(uuid.uuid4()), "primary", ttl=TTL, lease=SHORT)
    assert isinstance(again, Existing) and again.job.lease_expired
    watched = await hot.watch_job(job.owner, job.key)
    assert watched is not None and watched.lease_expired
    assert decide(job, "fp1", Policy()) == TakeOver(job.version)


async def test_renewing_keeps_the_lease_alive(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot, lease=SHORT)
    for _ in range(8):  # about 0.5 s, well past the original lease
        await asyncio.sleep(SHORT / 3)
        assert await hot.renew_lease(claimed.job, lease=SHORT)
        assert not (await current(hot, claimed.job)).lease_expired
    job = await job_of(operators, claimed.job.id)
    # A renewal is not a state change: the version (the CAS token) stays the same.
    assert (job.state, job.version) == (JobState.IN_FLIGHT, claimed.job.version)
    assert attempts(job) == [(1, AttemptState.STARTED, None, None)]
    await asyncio.sleep(PAST_SHORT)  # and once renewals stop, it runs out
    assert (await current(hot, claimed.job)).lease_expired
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)


async def test_renewing_an_expired_lease_revives_it_before_any_takeover(hot: JobStore) -> None:
    # A proxy stalled past its lease but nobody took the job over: it is still its job.
    job = await expired_lease(hot)
    assert await hot.renew_lease(job, lease=LEASE)
    renewed = await current(hot, job)
    assert not renewed.lease_expired
    assert not await hot.take_over(renewed)


async def test_renewing_a_job_that_is_no_longer_in_flight_fails(
    hot: JobStore, operators: Operators
) -> None:
    done = await claim(hot, "done")
    assert await hot.complete(done.job, 1, RESPONSE, ttl=TTL)
    assert not await hot.renew_lease(done.job, lease=LEASE)
    assert not await hot.renew_lease(await current(hot, done.job), lease=LEASE)

    unknown = await unknown_job(hot, operators, "unknown")
    assert not await hot.renew_lease(unknown, lease=LEASE)

    released = await claim(hot, "released")
    assert await hot.settle(released.job, 1, JobState.RELEASED, status=503)
    assert not await hot.renew_lease(await current(hot, released.job), lease=LEASE)

    for job in (done.job, unknown, released.job):
        assert (await current(hot, job)).lease_expired is False


async def test_renewing_with_a_stale_version_fails(hot: JobStore) -> None:
    claimed = await claim(hot)
    moved = await hot.fail_over(
        claimed.job, 1, "fallback", failure=AttemptFailure(503, "busy"), lease=SHORT
    )
    assert moved is not None
    assert not await hot.renew_lease(claimed.job, lease=LEASE)  # the old attempt's view
    assert await hot.renew_lease(moved.job, lease=LEASE)


async def test_only_jobs_in_flight_can_have_an_expired_lease(hot: JobStore) -> None:
    done = await claim(hot, "done", lease=0.05)
    assert await hot.complete(done.job, 1, RESPONSE, ttl=TTL)
    gone = await claim(hot, "gone", lease=0.05)
    assert await hot.settle(gone.job, 1, JobState.RELEASED, status=503)
    await asyncio.sleep(0.2)
    for job in (done.job, gone.job):
        assert not (await current(hot, job)).lease_expired
        assert not await hot.take_over(await current(hot, job))


# --- take_over (SPEC §3.5) --------------------------------------------------------------------


async def test_take_over_marks_the_job_and_its_running_attempts_unknown(
    hot: JobStore, operators: Operators
) -> None:
    claimed = await claim(hot, lease=0.05)
    assert await hot.add_attempt(claimed.job, "hedge", lease=0.05) == 2
    assert await hot.add_attempt(claimed.job, "third", lease=0.05) == 3
    await hot.finish_attempt(claimed.job, 3, JobState.RELEASED, status=503, error="busy")
    await asyncio.sleep(0.2)
    job = await current(hot, claimed.job)
    assert job.lease_expired

    assert await hot.take_over(job)

    after = await job_of(operators, job.id)
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
    assert await operators.count_unknown() == 1
    assert not await hot.take_over(job)  # and it happens once
    assert not await hot.take_over(after)


async def test_take_over_loses_while_the_lease_is_live(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    assert not await hot.take_over(claimed.job)
    # The database clock decides, not the caller's belief that the lease ran out.
    assert not await hot.take_over(claimed.job._replace(lease_expired=True))
    job = await job_of(operators, claimed.job.id)
    assert (job.state, job.version) == (JobState.IN_FLIGHT, claimed.job.version)
    assert attempts(job) == [(1, AttemptState.STARTED, None, None)]


async def test_take_over_with_a_stale_version_loses(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot, lease=0.05)
    moved = await hot.fail_over(
        claimed.job, 1, "fallback", failure=AttemptFailure(None, "refused"), lease=0.05
    )
    assert moved is not None
    await asyncio.sleep(0.2)
    assert not await hot.take_over(claimed.job)
    assert (await current(hot, claimed.job)).state is JobState.IN_FLIGHT
    assert await hot.take_over(moved.job)
    after = await job_of(operators, claimed.job.id)
    assert attempts(after) == [
        (1, AttemptState.FAILED, None, "refused"),
        (2, AttemptState.UNKNOWN, None, "lease expired"),
    ]


async def test_one_of_many_concurrent_takeovers_wins(
    hot: JobStore, operators: Operators, store_dsn: str
) -> None:
    job = await expired_lease(hot)
    async with open_store(store_dsn) as replica:  # a second proxy on the same database
        results = await asyncio.gather(
            *(s.take_over(job) for _ in range(8) for s in (hot, replica))
        )
    assert results.count(True) == 1, results
    after = await job_of(operators, job.id)
    assert (after.state, after.version) == (JobState.UNKNOWN, job.version + 1)
    assert attempts(after) == [(1, AttemptState.UNKNOWN, None, "lease expired")]


async def test_take_over_wakes_held_duplicates(hot: JobStore) -> None:
    claimed = await claim(hot, lease=0.3)
    async with held(hot, claimed.job) as sub:
        await asyncio.sleep(0.4)
        job = await current(hot, claimed.job)
        assert job.lease_expired
        assert await hot.take_over(job)
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


async def test_a_late_completion_after_a_takeover_is_discarded(
    hot: JobStore, operators: Operators
) -> None:
    # The proxy was only stalled, not dead: its result arrives after the takeover.
    claimed = await claim(hot, lease=0.05)
    await asyncio.sleep(0.2)
    assert await hot.take_over(await current(hot, claimed.job))

    assert not await hot.complete(claimed.job, 1, LATE, ttl=TTL)

    after = await job_of(operators, claimed.job.id)
    assert (after.state, after.response, after.completed_by) == (JobState.UNKNOWN, None, None)
    [attempt] = after.attempts
    # The race is recorded (with the status the upstream gave), the result never stored.
    assert (attempt.state, attempt.status) == (AttemptState.DISCARDED, LATE.status)
    assert attempt.finished_at is not None
    # Even with the post-takeover version, an unknown job cannot be completed by an attempt.
    assert not await hot.complete(after, 1, LATE, ttl=TTL)
    assert (await current(hot, after)).state is JobState.UNKNOWN


async def test_a_late_release_after_a_takeover_cannot_release_the_job(
    hot: JobStore, operators: Operators
) -> None:
    # The takeover said "may have executed": a late 503 must not let a retry run it again.
    claimed = await claim(hot, lease=0.05)
    await asyncio.sleep(0.2)
    assert await hot.take_over(await current(hot, claimed.job))
    assert not await hot.settle(claimed.job, 1, JobState.RELEASED, status=503)
    after = await job_of(operators, claimed.job.id)
    assert after.state is JobState.UNKNOWN
    assert attempts(after) == [(1, AttemptState.UNKNOWN, None, "lease expired")]
    assert await hot.start_next_attempt(after, "primary", lease=LEASE) is None


# --- fail_over and hedging (SPEC §3.4) --------------------------------------------------------


async def test_fail_over_starts_the_next_attempt_on_the_fallback(
    hot: JobStore, operators: Operators
) -> None:
    claimed = await claim(hot)
    moved = await hot.fail_over(
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
    job = await job_of(operators, claimed.job.id)
    assert attempts(job) == [
        (1, AttemptState.FAILED, 503, "upstream said 503"),
        (2, AttemptState.STARTED, None, None),
    ]
    assert [a.upstream for a in job.attempts] == ["primary", "fallback"]
    assert job.attempts[0].finished_at is not None and job.attempts[1].finished_at is None

    assert await hot.complete(moved.job, 2, RESPONSE, ttl=TTL)
    done = await job_of(operators, claimed.job.id)
    assert (done.state, done.completed_by, done.response) == (JobState.COMPLETED, 2, RESPONSE)


async def test_fail_over_along_a_chain_of_fallbacks(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    second = await hot.fail_over(
        claimed.job, 1, "b", failure=AttemptFailure(None, "refused"), lease=LEASE
    )
    assert second is not None
    third = await hot.fail_over(second.job, 2, "c", failure=AttemptFailure(429, None), lease=LEASE)
    assert third is not None and third.attempt == 3
    assert third.job.version == claimed.job.version + 2
    job = await job_of(operators, claimed.job.id)
    assert attempts(job) == [
        (1, AttemptState.FAILED, None, "refused"),
        (2, AttemptState.FAILED, 429, None),
        (3, AttemptState.STARTED, None, None),
    ]
    assert [a.upstream for a in job.attempts] == ["primary", "b", "c"]


async def test_fail_over_with_a_stale_version_changes_nothing(
    hot: JobStore, operators: Operators
) -> None:
    claimed = await claim(hot)
    assert await hot.fail_over(claimed.job, 1, "b", failure=AttemptFailure(503, None), lease=LEASE)
    assert (
        await hot.fail_over(claimed.job, 1, "c", failure=AttemptFailure(503, None), lease=LEASE)
        is None
    )
    job = await job_of(operators, claimed.job.id)
    assert (job.attempt_count, job.version) == (2, claimed.job.version + 1)
    assert [a.upstream for a in job.attempts] == ["primary", "b"]


@pytest.mark.parametrize("end", ["completed", "unknown", "released"])
async def test_no_fail_over_once_the_job_left_in_flight(
    hot: JobStore, operators: Operators, end: str
) -> None:
    claimed = await claim(hot)
    if end == "completed":
        assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    else:
        assert await hot.settle(claimed.job, 1, JobState(end), status=503)
    job = await current(hot, claimed.job)
    assert await hot.fail_over(job, 1, "b", failure=AttemptFailure(503, None), lease=LEASE) is None
    after = await job_of(operators, job.id)
    assert (after.state, after.version, after.attempt_count) == (job.state, job.version, 1)


async def test_of_concurrent_fail_overs_exactly_one_wins(
    hot: JobStore, operators: Operators
) -> None:
    claimed = await claim(hot)
    results = await asyncio.gather(
        *(
            hot.fail_over(claimed.job, 1, f"f{i}", failure=AttemptFailure(503, None), lease=LEASE)
            for i in range(8)
        )
    )
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    job = await job_of(operators, claimed.job.id)
    assert job.attempt_count == 2 and len(job.attempts) == 2


async def test_a_duplicate_counts_the_hedges_of_the_version_that_won(
    hot: JobStore, operators: Operators
) -> None:
    """A late attempt of an older version ending (its CAS lost) must not make a replay cache
    forget the attempts hedged under the version in flight now (found by the model test)."""
    claimed = await claim(hot)
    following = await hot.fail_over(
        claimed.job, 1, "f1", failure=AttemptFailure(503, None), lease=LEASE
    )
    assert following is not None and following.attempt == 2
    assert await hot.add_attempt(following.job, "hedge", lease=LEASE) == 3
    assert not await hot.settle(claimed.job, 1, JobState.UNKNOWN, error="late timeout")
    assert not await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    assert await hot.complete(following.job, 2, RESPONSE, ttl=TTL)

    duplicate = await hot.claim(intent(), str(uuid.uuid4()), "primary", ttl=TTL, lease=LEASE)
    assert isinstance(duplicate, Existing)
    assert duplicate.job.attempt_count == 3
    assert (await job_of(operators, claimed.job.id)).attempt_count == 3


async def test_finish_attempt_records_one_failure_and_leaves_the_job_alone(
    hot: JobStore, operators: Operators
) -> None:
    claimed = await claim(hot)
    assert await hot.add_attempt(claimed.job, "hedge", lease=LEASE) == 2

    await hot.finish_attempt(claimed.job, 1, JobState.RELEASED, status=503, error="busy")

    job = await job_of(operators, claimed.job.id)
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

    await hot.finish_attempt(claimed.job, 2, JobState.UNKNOWN, error="timeout")
    job = await job_of(operators, claimed.job.id)
    assert (job.state, job.version) == (JobState.IN_FLIGHT, claimed.job.version)
    assert attempts(job)[1] == (2, AttemptState.UNKNOWN, None, "timeout")


async def test_finish_attempt_never_rewrites_a_finished_attempt(
    hot: JobStore, operators: Operators
) -> None:
    claimed = await claim(hot)
    assert await hot.add_attempt(claimed.job, "hedge", lease=LEASE) == 2
    assert await hot.complete(claimed.job, 2, RESPONSE, ttl=TTL)
    await hot.finish_attempt(claimed.job, 2, JobState.UNKNOWN, error="late timeout")
    await hot.finish_attempt(claimed.job, 1, JobState.RELEASED, status=503, error="busy")
    job = await job_of(operators, claimed.job.id)
    assert (job.state, job.completed_by, job.response) == (JobState.COMPLETED, 2, RESPONSE)
    assert attempts(job) == [
        (1, AttemptState.FAILED, 503, "busy"),
        (2, AttemptState.SUCCEEDED, 201, None),
    ]


async def test_a_hedged_attempt_shares_the_version_and_extends_the_lease(hot: JobStore) -> None:
    # The hedge's lease ends at least 1 s after the first's, and the job is read 0.2 s after the
    # first's: a loaded machine has 0.8 s for the statements in between.
    claimed = await claim(hot, lease=2.0)
    await asyncio.sleep(1.0)
    assert await hot.add_attempt(claimed.job, "hedge", lease=2.0) == 2
    await asyncio.sleep(1.2)  # past the first lease (2 s), not the hedge's (3 s or more)
    job = await current(hot, claimed.job)
    assert (job.version, job.lease_expired) == (claimed.job.version, False)
    # Renewal covers every running attempt of the job.
    assert await hot.renew_lease(job, lease=LEASE)
    assert not (await current(hot, job)).lease_expired


# --- resolve (SPEC §3.3) ----------------------------------------------------------------------


# --- delete, stale_unknown, count_unknown (SPEC §3.3, §13) ------------------------------------


# --- expired_leases: the background takeover (SPEC §3.5) ---------------------------------------


# --- late responses kept for the operator (SPEC §3.3) ------------------------------------------


async def test_a_late_response_after_a_takeover_is_kept_on_its_attempt(
    hot: JobStore, operators: Operators
) -> None:
    job = await expired_lease(hot)
    assert await hot.take_over(job)
    assert not await hot.complete(job, 1, LATE, ttl=TTL)
    taken = await job_of(operators, job.id)
    assert taken.state is JobState.UNKNOWN
    assert attempts(taken) == [(1, AttemptState.DISCARDED, 200, "lease expired")]
    assert taken.attempts[0].late_bytes == len(LATE.body or b"")
    assert await operators.late_response(taken, 1) == LATE
    assert await operators.late_response(taken, 2) is None
    # Resolved with it: the job replays what the upstream really answered.
    kept = await operators.late_response(taken, 1)
    assert await operators.resolve(taken, JobState.COMPLETED, response=kept, ttl=TTL)
    assert (await current(hot, taken)).response == LATE


async def test_a_hedging_losers_response_is_not_kept(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    second = await hot.add_attempt(claimed.job, "fallback", lease=LEASE)
    assert second == 2
    assert await hot.complete(claimed.job, 2, RESPONSE, ttl=TTL)
    assert not await hot.complete(claimed.job, 1, LATE, ttl=TTL)  # the job is completed
    done = await job_of(operators, claimed.job.id)
    assert [a.late_bytes for a in done.attempts] == [None, None]
    assert await operators.late_response(done, 1) is None


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
