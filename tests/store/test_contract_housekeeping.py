"""The store contract of housekeeping (SPEC §3.3 `unknown_ttl`, §3.5, §11 expiry): what the
background tasks read and delete, on every store of tests/store/conftest.py."""

from __future__ import annotations

import asyncio

from idemproxy.core.types import (
    AttemptState,
    JobState,
)
from idemproxy.store.ports import Housekeeping, JobStore, Operators

from .test_contract import claim as claim_with_ttl
from .test_contract import completed, settled
from .test_contract_attempts import (
    LEASE,
    RESPONSE,
    TTL,
    attempts,
    claim,
    expired_lease,
    job_of,
    unknown_job,
)


async def test_sweep_deletes_expired_terminal_jobs_in_batches(
    hot: JobStore, operators: Operators, housekeeping: Housekeeping
) -> None:
    gone = [await completed(hot, operators, f"c{i}", ttl=0) for i in range(5)]
    gone += [await settled(hot, operators, JobState.RELEASED, f"r{i}", ttl=0) for i in range(2)]
    assert [await housekeeping.sweep_expired(3) for _ in range(4)] == [3, 3, 1, 0]
    for job in gone:
        assert await operators.get_by_id(job.id) is None


async def test_sweep_never_deletes_in_flight_unknown_or_live_jobs(
    hot: JobStore, operators: Operators, housekeeping: Housekeeping
) -> None:
    kept = [
        (await claim_with_ttl(hot, "in-flight", ttl=0)).job,
        await settled(hot, operators, JobState.UNKNOWN, "unknown", ttl=0),
        await completed(hot, operators, "live"),
        await settled(hot, operators, JobState.RELEASED, "live-released"),
    ]
    assert await housekeeping.sweep_expired(100) == 0
    for job in kept:
        assert await operators.get_by_id(job.id) is not None


async def test_stale_unknown_lists_old_unknown_jobs_oldest_first(
    hot: JobStore, operators: Operators, housekeeping: Housekeeping
) -> None:
    # "young" must stay younger than `stale_after` through the checks below, which on a loaded
    # machine (a Citus cluster's multi-shard reads included) take a good part of a second.
    stale_after, aged = 1.5, 1.8
    old = []
    for i in range(3):
        old.append(await unknown_job(hot, operators, f"old-{i}"))
        await asyncio.sleep(0.01)  # distinct updated_at, even at SQLite's millisecond clock
    assert all(job.updated_at is not None for job in old)
    done = await claim(hot, "done")
    assert await hot.complete(done.job, 1, RESPONSE, ttl=TTL)
    await claim(hot, "in-flight")
    released = await claim(hot, "released")
    assert await hot.settle(released.job, 1, JobState.RELEASED, status=503)
    resolved = await unknown_job(hot, operators, "resolved")
    assert await operators.resolve(resolved, JobState.RELEASED)
    await asyncio.sleep(aged)
    young = await unknown_job(hot, operators, "young")

    stale = await housekeeping.stale_unknown(stale_after, 10)
    assert [job.id for job in stale] == [job.id for job in old]
    assert all(job.state is JobState.UNKNOWN for job in stale)
    first_two = await housekeeping.stale_unknown(stale_after, 2)
    assert [job.id for job in first_two] == [job.id for job in old[:2]]
    assert young.id in {job.id for job in await housekeeping.stale_unknown(0, 10)}
    assert await housekeeping.stale_unknown(60, 10) == []

    # A job becomes stale when it last changed, not when it was created.
    assert await housekeeping.stale_unknown(stale_after, 10) == stale
    settled_late = await claim(hot, "settled-late")
    await asyncio.sleep(aged)
    assert await hot.settle(settled_late.job, 1, JobState.UNKNOWN, error="timeout")
    assert settled_late.job.id not in {
        job.id for job in await housekeeping.stale_unknown(stale_after, 10)
    }


async def test_stale_unknown_jobs_can_be_released_by_their_version(
    hot: JobStore, operators: Operators, housekeeping: Housekeeping
) -> None:
    # What unknown_ttl does with them: resolve by CAS on the version it listed.
    job = await unknown_job(hot, operators)
    await asyncio.sleep(0.1)
    [stale] = await housekeeping.stale_unknown(0.05, 10)
    assert stale.version == job.version
    assert await operators.resolve(stale, JobState.RELEASED, resolution="unknown_ttl")
    assert await housekeeping.stale_unknown(0, 10) == []


async def test_expired_leases_lists_jobs_in_flight_whose_lease_ran_out_long_enough_ago(
    hot: JobStore,
    operators: Operators,
    housekeeping: Housekeeping,
) -> None:
    first = await expired_lease(hot, "dead-1")
    second = await expired_lease(hot, "dead-2")
    await claim(hot, "alive")  # a live lease
    done = await claim(hot, "done", lease=0.05)
    assert await hot.complete(done.job, 1, RESPONSE, ttl=TTL)
    await unknown_job(hot, operators, "unknown")

    found = await housekeeping.expired_leases(0.0, 10)
    assert [job.id for job in found] == [first.id, second.id]  # the oldest lease first
    assert all(job.state is JobState.IN_FLIGHT and job.lease_expired for job in found)
    assert [job.id for job in await housekeeping.expired_leases(0.0, 1)] == [first.id]
    # Not yet one `older_than` past the lease's end, by the database clock.
    assert await housekeeping.expired_leases(60.0, 10) == []

    # What the background pass does with each: the request's own takeover CAS.
    assert await hot.take_over(found[0])
    assert not await hot.take_over(found[0])
    taken = await job_of(operators, first.id)
    assert taken.state is JobState.UNKNOWN
    assert attempts(taken) == [(1, AttemptState.UNKNOWN, None, "lease expired")]
    assert [job.id for job in await housekeeping.expired_leases(0.0, 10)] == [second.id]
    # A lease renewed meanwhile (a live proxy that was only late) is not taken over.
    assert await hot.renew_lease(found[1], lease=LEASE)
    assert not await hot.take_over(found[1])
    assert await housekeeping.expired_leases(0.0, 10) == []


async def test_expired_leases_finds_a_hedged_job_whose_every_attempt_ended_unsettled(
    hot: JobStore,
    operators: Operators,
    housekeeping: Housekeeping,
) -> None:
    # SPEC §3.5: a hedged race (§3.4) ends each losing racer alone; a proxy that dies after the
    # last racer ended and before it settled the job leaves it in flight with no attempt running.
    # The background takeover must still find it once its lease ran out.
    claimed = await claim(hot, "hedged", lease=0.05)
    assert await hot.add_attempt(claimed.job, "hedge", lease=0.05) == 2
    await hot.finish_attempt(claimed.job, 1, JobState.RELEASED, status=503, error="busy")
    await hot.finish_attempt(claimed.job, 2, JobState.UNKNOWN, status=None, error="reset")
    await asyncio.sleep(0.2)

    found = await housekeeping.expired_leases(0.0, 10)
    assert [job.id for job in found] == [claimed.job.id]
    assert await hot.take_over(found[0])
    taken = await job_of(operators, claimed.job.id)
    assert taken.state is JobState.UNKNOWN
    # Each racer keeps the outcome it ended with; none is running any more.
    assert attempts(taken) == [
        (1, AttemptState.FAILED, 503, "busy"),
        (2, AttemptState.UNKNOWN, None, "reset"),
    ]
    assert await housekeeping.expired_leases(0.0, 10) == []


async def test_expired_leases_forgets_the_racers_of_a_hedged_job_that_ended(
    hot: JobStore,
    operators: Operators,
    housekeeping: Housekeeping,
) -> None:
    # A racer that ended alone while its job went on leaves the lease scan once the job ends,
    # however it ends: completed by another racer, settled, or taken over.
    jobs = {}
    for key in ("completed", "settled", "taken"):
        claimed = await claim(hot, key, lease=0.05)
        assert await hot.add_attempt(claimed.job, "hedge", lease=0.05) == 2
        await hot.finish_attempt(claimed.job, 1, JobState.RELEASED, status=503, error="busy")
        jobs[key] = claimed.job
    assert await hot.complete(jobs["completed"], 2, RESPONSE, ttl=TTL)
    assert await hot.settle(jobs["settled"], 2, JobState.RELEASED, status=503, error="busy")
    await asyncio.sleep(0.2)
    assert [job.id for job in await housekeeping.expired_leases(0.0, 10)] == [jobs["taken"].id]
    assert await hot.take_over(await job_of(operators, jobs["taken"].id))
    assert await housekeeping.expired_leases(0.0, 10) == []
