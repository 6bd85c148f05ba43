"""The store contract for questions about unknown attempts (SPEC §3.6): the right to ask is a
compare-and-swap, due by the database clock, and what was asked and answered stays on the
attempt. Runs on every store of tests/store/conftest.py."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

from idemproxy.constants import MAX_EVIDENCE_ENTRIES
from idemproxy.core.resolution import Backoff
from idemproxy.core.types import Claimed, Evidence, Intent, Job, JobState, StoredResponse
from idemproxy.store.base import Store

TTL = 3600.0
LEASE = 30.0
ASKED = datetime(2026, 1, 1, 3, 0, tzinfo=UTC)


async def unknown_job(store: Store, key: str = "k1") -> Job:
    intent = Intent("alice", key, "fp1", "POST", "/charges")
    claimed = await store.claim(intent, str(uuid.uuid4()), "primary", ttl=TTL, lease=LEASE)
    assert isinstance(claimed, Claimed)
    assert await store.settle(claimed.job, 1, JobState.UNKNOWN, error="timeout")
    job = await store.get_by_id(claimed.job.id)
    assert job is not None
    return job


def evidence(n: int, verdict: str = "unknown") -> Evidence:
    answered = ASKED + timedelta(seconds=n, milliseconds=250)
    return Evidence("reconcile", ASKED + timedelta(seconds=n), answered, 503, verdict, f"try {n}")


async def test_a_new_attempt_has_no_evidence(store: Store) -> None:
    job = await unknown_job(store)
    (attempt,) = job.attempts
    assert (attempt.checks, attempt.checked_at, attempt.evidence) == (0, None, ())


async def test_one_of_several_askers_at_once_wins(store: Store) -> None:
    job = await unknown_job(store)
    tries = [store.claim_check(job, 1, checks=0, due_after=0) for _ in range(5)]
    assert sorted(await asyncio.gather(*tries)) == [False] * 4 + [True]
    found = await store.get_by_id(job.id)
    assert found is not None
    (attempt,) = found.attempts
    assert attempt.checks == 1 and attempt.checked_at is not None
    # The next question counts from this one, by the database clock.
    assert not await store.claim_check(job, 1, checks=1, due_after=60)
    assert await store.claim_check(job, 1, checks=1, due_after=0)


async def test_not_due_before_its_backoff(store: Store) -> None:
    job = await unknown_job(store)
    assert not await store.claim_check(job, 1, checks=0, due_after=60)
    await asyncio.sleep(0.3)
    assert await store.claim_check(job, 1, checks=0, due_after=0.2)


async def test_only_while_the_job_is_unknown_at_the_version_read(store: Store) -> None:
    job = await unknown_job(store)
    assert await store.resolve(job, JobState.RELEASED)
    assert not await store.claim_check(job, 1, checks=0, due_after=0)
    moved = await store.get_by_id(job.id)
    assert moved is not None
    assert not await store.claim_check(moved, 1, checks=0, due_after=0)  # released now
    other = await unknown_job(store, "k2")
    assert not await store.claim_check(other, 2, checks=0, due_after=0)  # no such attempt


async def test_an_operator_resolution_still_wins_after_a_question(store: Store) -> None:
    job = await unknown_job(store)
    assert await store.claim_check(job, 1, checks=0, due_after=0)
    response = StoredResponse(200, (), b"by hand")
    assert await store.resolve(job, JobState.COMPLETED, response=response, ttl=TTL)
    # The reconciler's own resolution, at the version it read, loses.
    assert not await store.resolve(job, JobState.RELEASED, resolution="reconcile")


async def test_evidence_is_kept_in_order_and_bounded(store: Store) -> None:
    job = await unknown_job(store)
    await store.record_evidence(job, 1, evidence(0))
    found = await store.get_by_id(job.id)
    assert found is not None and found.attempts[0].evidence == (evidence(0),)
    for n in range(1, MAX_EVIDENCE_ENTRIES + 5):
        await store.record_evidence(job, 1, evidence(n))
    found = await store.get_by_id(job.id)
    assert found is not None
    kept = found.attempts[0].evidence
    assert kept == tuple(evidence(n) for n in range(5, MAX_EVIDENCE_ENTRIES + 5))


async def test_evidence_without_an_answer(store: Store) -> None:
    job = await unknown_job(store)
    silent = Evidence("upstream_key", ASKED, None, None, "unknown", "no answer")
    await store.record_evidence(job, 1, silent)
    found = await store.get_by_id(job.id)
    assert found is not None and found.attempts[0].evidence == (silent,)


async def test_the_digest_of_what_an_attempt_sent_is_kept(store: Store) -> None:
    job = await unknown_job(store)
    await store.note_sent(job, 1, "d" * 64)
    found = await store.get_by_id(job.id)
    assert found is not None and found.attempts[0].sent_digest == "d" * 64


async def test_one_retry_resends_an_unknown_job_within_the_window(store: Store) -> None:
    job = await unknown_job(store)
    tries = [
        store.resend(job, 1, "primary", window=60, lease=LEASE, token=str(uuid.uuid4()))
        for _ in range(4)
    ]
    won = [claimed for claimed in await asyncio.gather(*tries) if claimed is not None]
    assert len(won) == 1
    (claimed,) = won
    assert claimed.attempt == 2
    assert (claimed.job.state, claimed.job.version) == (JobState.IN_FLIGHT, job.version + 1)
    # Its answer completes the job by the usual CAS; the unknown attempt stays what it was.
    response = StoredResponse(201, (), b"the upstream's own answer")
    assert await store.complete(claimed.job, 2, response, ttl=TTL)
    done = await store.get_by_id(job.id)
    assert done is not None and (done.state, done.completed_by) == (JobState.COMPLETED, 2)
    assert [a.state.value for a in done.attempts] == ["unknown", "succeeded"]


async def test_no_resend_past_the_window_by_the_database_clock(store: Store) -> None:
    job = await unknown_job(store)
    await asyncio.sleep(0.3)
    assert (
        await store.resend(job, 1, "primary", window=0.2, lease=LEASE, token=str(uuid.uuid4()))
        is None
    )
    found = await store.get_by_id(job.id)
    assert found is not None and (found.state, found.version) == (JobState.UNKNOWN, job.version)


async def test_no_resend_of_a_job_resolved_meanwhile(store: Store) -> None:
    job = await unknown_job(store)
    assert await store.resolve(job, JobState.RELEASED)
    assert (
        await store.resend(job, 1, "primary", window=60, lease=LEASE, token=str(uuid.uuid4()))
        is None
    )


# SPEC §3.6: the pages of the unknown jobs due a question, read by the background reconciler.
NOW = Backoff(first=0.0, longest=0.0, answer_within=0.0)
BEFORE_EVERY_ID = "00000000-0000-0000-0000-000000000000"


async def test_every_due_unknown_job_is_listed_page_by_page(store: Store) -> None:
    jobs = [await unknown_job(store, f"k{n}") for n in range(5)]
    intent = Intent("alice", "done", "fp1", "POST", "/charges")
    done = await store.claim(intent, str(uuid.uuid4()), "primary", ttl=TTL, lease=LEASE)
    assert isinstance(done, Claimed)  # completed: never listed
    assert await store.complete(done.job, 1, StoredResponse(201, (), b"{}"), ttl=TTL)
    await asyncio.sleep(0.05)
    listed, after = [], BEFORE_EVERY_ID
    while page := await store.due_unknown(NOW, after=after, limit=2):
        assert len(page) <= 2 and all(job.id > after for job in page)
        listed += [job.id for job in page]
        after = page[-1].id
    assert listed == sorted(job.id for job in jobs)


async def test_due_by_the_backoff_of_its_latest_unknown_attempt(store: Store) -> None:
    job = await unknown_job(store)
    await asyncio.sleep(0.3)
    assert await store.due_unknown(Backoff(60, 60, 0), after=BEFORE_EVERY_ID, limit=10) == []
    (due,) = await store.due_unknown(Backoff(0.2, 60, 0), after=BEFORE_EVERY_ID, limit=10)
    assert due.id == job.id and due.state is JobState.UNKNOWN
    # Asked once: due again after the time an answer may take plus twice the first wait (a
    # margin of seconds either way: a loaded machine may take a tenth of one between the two).
    assert await store.claim_check(job, 1, checks=0, due_after=0)
    assert await store.due_unknown(Backoff(0.1, 60, 5.0), after=BEFORE_EVERY_ID, limit=10) == []
    await asyncio.sleep(0.3)
    (again,) = await store.due_unknown(Backoff(0.05, 60, 0.1), after=BEFORE_EVERY_ID, limit=10)
    assert again.id == job.id
