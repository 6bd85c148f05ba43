"""The store contract of the operators' interface (SPEC §3.3, §11, §13): what the admin API and
`idemproxy jobs` read and change, on the store of record, while the hot path's layers in front
learn of it. Every test runs on every store of tests/store/conftest.py."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from idemproxy.core.decision import Policy, Replay, decide
from idemproxy.core.types import (
    AttemptState,
    Claimed,
    Existing,
    Job,
    JobState,
    StoredResponse,
)
from idemproxy.errors import InvalidRequest
from idemproxy.identity.intent import new_job_id
from idemproxy.ops.purge import purge_owner
from idemproxy.ops.service import find_by_key, list_jobs
from idemproxy.store.ports import JobStore, Operators

from .test_contract import RESPONSE as COMPLETED_RESPONSE
from .test_contract import completed, ids, settled
from .test_contract_attempts import (
    LEASE,
    OPERATOR,
    RESPONSE,
    TTL,
    WAKE_TIMEOUT,
    attempts,
    claim,
    current,
    expired_lease,
    held,
    intent,
    job_of,
    open_store,
    unknown_job,
    wait_until_listening,
)
from .test_contract_owners import FIRST, UPSTREAM, _intent


async def test_list_jobs_filters_by_state_and_owner(hot: JobStore, operators: Operators) -> None:
    done = await completed(hot, operators, "a")
    unknown = await settled(hot, operators, JobState.UNKNOWN, "b")
    bobs = (await claim(hot, "a", owner="bob")).job
    assert ids(await operators.list_jobs()) == {done.id, unknown.id, bobs.id}
    assert ids(await operators.list_jobs(state=JobState.UNKNOWN)) == {unknown.id}
    assert ids(await operators.list_jobs(owner="bob")) == {bobs.id}
    assert ids(await operators.list_jobs(state=JobState.IN_FLIGHT, owner="alice")) == set()
    assert len(await operators.list_jobs(limit=2)) == 2


async def test_listed_jobs_carry_their_response(hot: JobStore, operators: Operators) -> None:
    done = await completed(hot, operators)
    [listed] = await operators.list_jobs(state=JobState.COMPLETED)
    assert (listed.id, listed.response, listed.version) == (
        done.id,
        COMPLETED_RESPONSE,
        done.version,
    )


async def test_resolve_as_completed_stores_a_response_to_replay(
    hot: JobStore, operators: Operators
) -> None:
    job = await unknown_job(hot, operators)
    assert await operators.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL)

    found = await current(hot, job)
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
    again = await hot.claim(intent(), str(uuid.uuid4()), "primary", ttl=TTL, lease=LEASE)
    assert isinstance(again, Existing) and again.job.response == OPERATOR
    # The attempt history is not rewritten: it really did end unknown.
    assert attempts(await job_of(operators, job.id)) == [(1, AttemptState.UNKNOWN, None, "timeout")]
    assert await operators.count_unknown() == 0


async def test_resolve_as_released_lets_the_next_retry_run(
    hot: JobStore, operators: Operators
) -> None:
    job = await unknown_job(hot, operators)
    assert await operators.resolve(job, JobState.RELEASED, resolution="unknown_ttl")

    found = await current(hot, job)
    assert (found.state, found.version, found.resolution, found.response) == (
        JobState.RELEASED,
        job.version + 1,
        "unknown_ttl",
        None,
    )
    started = await hot.start_next_attempt(found, "primary", lease=LEASE)
    assert started is not None and started.attempt == 2
    assert await hot.complete(started.job, 2, RESPONSE, ttl=TTL)
    done = await job_of(operators, job.id)
    assert (done.state, done.completed_by) == (JobState.COMPLETED, 2)
    assert [a.state for a in done.attempts] == [AttemptState.UNKNOWN, AttemptState.SUCCEEDED]


async def test_resolve_a_job_that_was_taken_over(hot: JobStore, operators: Operators) -> None:
    job = await expired_lease(hot)
    assert await hot.take_over(job)
    taken = await current(hot, job)
    assert await operators.resolve(taken, JobState.COMPLETED, response=OPERATOR, ttl=TTL)
    assert (await current(hot, job)).response == OPERATOR


@pytest.mark.parametrize("state", [JobState.COMPLETED, JobState.RELEASED])
async def test_resolve_only_settles_unknown_jobs(
    hot: JobStore, operators: Operators, state: JobState
) -> None:
    in_flight = (await claim(hot, "in-flight")).job
    done = await claim(hot, "done")
    assert await hot.complete(done.job, 1, RESPONSE, ttl=TTL)
    released = await claim(hot, "released")
    assert await hot.settle(released.job, 1, JobState.RELEASED, status=503)
    for job in (in_flight, await current(hot, done.job), await current(hot, released.job)):
        assert not await operators.resolve(job, state, response=OPERATOR, ttl=TTL)
        after = await current(hot, job)
        assert (after.state, after.version, after.resolution) == (job.state, job.version, None)
    assert (await current(hot, done.job)).response == RESPONSE


async def test_resolve_with_a_stale_version_loses(hot: JobStore, operators: Operators) -> None:
    job = await unknown_job(hot, operators)
    assert await operators.resolve(job, JobState.RELEASED)
    assert not await operators.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL)
    assert not await operators.resolve(job, JobState.RELEASED)
    after = await current(hot, job)
    assert (after.state, after.version, after.response) == (
        JobState.RELEASED,
        job.version + 1,
        None,
    )


async def test_of_two_concurrent_resolutions_exactly_one_wins(
    hot: JobStore, operators: Operators, store_dsn: str
) -> None:
    job = await unknown_job(hot, operators)
    async with open_store(store_dsn) as other_operator:
        results = await asyncio.gather(
            operators.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL),
            other_operator.resolve(job, JobState.RELEASED),
            operators.resolve(job, JobState.RELEASED),
            other_operator.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL),
        )
    assert results.count(True) == 1, results
    after = await current(hot, job)
    assert after.version == job.version + 1
    winner = results.index(True)
    if winner in (0, 3):
        assert (after.state, after.response) == (JobState.COMPLETED, OPERATOR)
    else:
        assert (after.state, after.response) == (JobState.RELEASED, None)


@pytest.mark.parametrize("response", [None, StoredResponse(200, (), None)], ids=["none", "omitted"])
async def test_resolve_as_completed_needs_a_body(
    hot: JobStore, operators: Operators, response: StoredResponse | None
) -> None:
    job = await unknown_job(hot, operators)
    with pytest.raises(ValueError, match="needs a response"):
        await operators.resolve(job, JobState.COMPLETED, response=response)
    with pytest.raises(ValueError):
        await operators.resolve(job, JobState.IN_FLIGHT)
    assert (await current(hot, job)).state is JobState.UNKNOWN


@pytest.mark.parametrize("state", [JobState.COMPLETED, JobState.RELEASED])
async def test_resolve_wakes_waiters(hot: JobStore, operators: Operators, state: JobState) -> None:
    job = await unknown_job(hot, operators)
    await wait_until_listening(hot)
    async with hot.watching(job.id) as sub:
        assert await operators.resolve(job, state, response=OPERATOR, ttl=TTL)
        assert await sub.wait(WAKE_TIMEOUT)


async def test_delete_removes_the_job_and_its_attempts(hot: JobStore, operators: Operators) -> None:
    job = await unknown_job(hot, operators)
    assert await operators.delete(job)
    assert await operators.get_by_id(job.id) is None
    assert await hot.get(job.owner, job.key) is None
    assert not await operators.delete(job)
    # The key is free again: a new job with a fresh first attempt.
    fresh = await claim(hot)
    assert fresh.job.id != job.id
    assert attempts(await job_of(operators, fresh.job.id)) == [
        (1, AttemptState.STARTED, None, None)
    ]


async def test_delete_is_a_cas_on_the_version_and_names_the_owner(
    hot: JobStore, operators: Operators
) -> None:
    alice = await unknown_job(hot, operators)
    bob = await claim(hot, owner="bob")
    assert not await operators.delete(alice._replace(owner="bob"))  # bob's key, alice's id
    assert not await operators.delete(alice._replace(version=alice.version - 1))  # changed since
    assert not await operators.delete(alice._replace(version=alice.version + 7), force=True)
    assert await operators.get_by_id(alice.id) is not None
    assert await operators.delete(alice)
    assert await operators.get_by_id(alice.id) is None
    assert await operators.get_by_id(bob.job.id) is not None


async def test_delete_refuses_a_job_in_flight_with_a_live_lease_unless_forced(
    hot: JobStore,
    operators: Operators,
) -> None:
    running = await claim(hot)
    assert not await operators.delete(running.job)
    assert await operators.get_by_id(running.job.id) is not None
    assert await operators.delete(running.job, force=True)
    assert await operators.get_by_id(running.job.id) is None
    # Its lease ran out by the database clock (its proxy died): no force needed.
    dead = await expired_lease(hot, "k2")
    assert await operators.delete(dead)


async def test_delete_of_a_released_job_a_retry_restarted_loses(
    hot: JobStore, operators: Operators
) -> None:
    claimed = await claim(hot)
    assert await hot.settle(claimed.job, 1, JobState.RELEASED, status=503)
    read = await current(hot, claimed.job)  # what an operator saw: released
    assert await hot.start_next_attempt(read, "primary", lease=LEASE) is not None
    assert not await operators.delete(read)
    assert not await operators.delete(read, force=True)
    assert (await current(hot, read)).state is JobState.IN_FLIGHT


async def test_delete_wakes_waiters(hot: JobStore, operators: Operators) -> None:
    claimed = await claim(hot)
    async with held(hot, claimed.job) as sub:
        assert await operators.delete(claimed.job, force=True)
        assert await sub.wait(WAKE_TIMEOUT)


async def test_count_unknown(hot: JobStore, operators: Operators) -> None:
    assert await operators.count_unknown() == 0
    first = await unknown_job(hot, operators, "a")
    second = await unknown_job(hot, operators, "b")
    done = await claim(hot, "c")
    assert await hot.complete(done.job, 1, RESPONSE, ttl=TTL)
    await claim(hot, "d")
    stalled = await expired_lease(hot, "e")  # in flight with an expired lease: not unknown yet
    assert await operators.count_unknown() == 2
    assert await hot.take_over(stalled)
    assert await operators.count_unknown() == 3
    assert await operators.resolve(first, JobState.RELEASED)
    assert await operators.delete(second)
    assert await operators.count_unknown() == 1


async def test_owner_jobs_pages_one_owners_jobs_in_id_order(
    hot: JobStore, operators: Operators
) -> None:
    ids = []
    for key in ("k1", "k2", "k3"):
        claimed = await hot.claim(_intent(key), new_job_id(), UPSTREAM, ttl=TTL, lease=LEASE)
        assert isinstance(claimed, Claimed)
        ids.append(claimed.job.id)
    legacy = str(uuid.uuid4())  # an id of the versions before UUIDv7 ids
    assert isinstance(
        await hot.claim(_intent("old"), legacy, UPSTREAM, ttl=TTL, lease=LEASE), Claimed
    )
    assert isinstance(
        await hot.claim(_intent("k1", "bob"), new_job_id(), UPSTREAM, ttl=TTL, lease=LEASE),
        Claimed,
    )
    later = datetime.now(UTC) + timedelta(minutes=1)
    seen: list[str] = []
    after = FIRST
    while batch := await operators.owner_jobs("alice", after=after, before=later, limit=2):
        assert len(batch) <= 2 and all(job.owner == "alice" for job in batch)
        seen.extend(job.id for job in batch)
        after = batch[-1].id
    assert seen == sorted([*ids, legacy])
    every = await operators.owner_jobs("alice", after=FIRST, before=later, limit=10)
    assert {job.state for job in every} == {JobState.IN_FLIGHT}
    earlier = datetime.now(UTC) - timedelta(minutes=1)
    assert await operators.owner_jobs("alice", after=FIRST, before=earlier, limit=10) == []


async def test_the_clock_is_the_one_that_stamps_created_at(
    hot: JobStore, operators: Operators
) -> None:
    """An erasure's cut-off (SPEC §11): every job claimed before the clock was read is before
    it, every job claimed after is not, whatever this host's clock says."""
    before = await hot.claim(_intent("before"), new_job_id(), UPSTREAM, ttl=TTL, lease=LEASE)
    await asyncio.sleep(0.01)
    cut = await operators.clock()
    assert cut.tzinfo is not None
    assert abs((cut - datetime.now(UTC)).total_seconds()) < 5  # this machine's clock, near
    await asyncio.sleep(0.01)
    after = await hot.claim(_intent("after"), new_job_id(), UPSTREAM, ttl=TTL, lease=LEASE)
    assert isinstance(before, Claimed) and isinstance(after, Claimed)
    listed = await operators.owner_jobs("alice", after=FIRST, before=cut, limit=10)
    assert [job.id for job in listed] == [before.job.id]
    created = (before.job.created_at, after.job.created_at)
    assert created[0] is not None and created[1] is not None
    assert created[0] < cut <= created[1]


class _ClaimsDuringThePurge:
    """The operators' interface, with a job of the owner claimed and completed once the
    purge's first batch was read: a client's request sent while the purge runs."""

    def __init__(self, hot: JobStore, operators: Operators) -> None:
        self._hot, self._operators = hot, operators
        self.claimed: Job | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._operators, name)

    async def owner_jobs(self, owner: str, **batch: Any) -> list[Job]:
        jobs = await self._operators.owner_jobs(owner, **batch)
        if self.claimed is None:
            await asyncio.sleep(0.01)
            self.claimed = await _completed_of(self._hot, self._operators, "sent-meanwhile")
        return jobs


CUSTOMER = "c" * 64  # an owner hash, as an erasure names one


async def _completed_of(hot: JobStore, operators: Operators, key: str) -> Job:
    claimed = await claim(hot, key, owner=CUSTOMER)
    assert await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    return await job_of(operators, claimed.job.id)


async def test_a_purge_leaves_the_jobs_claimed_after_it_began(
    hot: JobStore, operators: Operators
) -> None:
    """SPEC §11: a request sent while an owner's erasure runs is neither cut off nor erased
    (its retry would execute again), whatever the clocks of the hosts involved say."""
    old = [await _completed_of(hot, operators, f"old-{n}") for n in range(3)]
    during = _ClaimsDuringThePurge(hot, operators)
    report = await purge_owner(cast(Operators, during), CUSTOMER, batch_size=1)
    assert (report.removed_jobs, report.batches, report.left) == (3, 3, [])
    assert during.claimed is not None
    assert await operators.get_by_id(during.claimed.id) == during.claimed
    assert [await operators.get_by_id(job.id) for job in old] == [None, None, None]


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ("A" * 64, "a" * 64),  # an owner hash in upper case is the one the store keeps
        ("anonymous", "anonymous"),
        ("webhook:Stripe", "webhook:Stripe"),
    ],
)
async def test_an_owner_hash_is_named_in_any_case(
    hot: JobStore, operators: Operators, given: str, named: str
) -> None:
    claimed = await hot.claim(_intent("k", named), new_job_id(), UPSTREAM, ttl=TTL, lease=LEASE)
    assert isinstance(claimed, Claimed) and await hot.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    assert ids(await list_jobs(operators, state=None, owner=given, limit=10)) == {claimed.job.id}
    assert (await find_by_key(operators, "k", (given, None))).id == claimed.job.id
    report = await purge_owner(operators, given)
    assert (report.owner, report.removed_jobs) == (named, 1)


@pytest.mark.parametrize(
    "given",
    ["a" * 8, "A" * 63, "f" * 65, "a" * 8 + "...", "owner=" + "a" * 8, "a" * 63 + "g", "webhook:"],
)
async def test_part_of_an_owner_hash_is_refused_not_matched_to_nothing(
    operators: Operators, given: str
) -> None:
    """An erasure that found no job would read as done."""
    with pytest.raises(InvalidRequest, match="is not an owner"):
        await purge_owner(operators, given)
    with pytest.raises(InvalidRequest, match="is not an owner"):
        await list_jobs(operators, state=None, owner=given, limit=10)
