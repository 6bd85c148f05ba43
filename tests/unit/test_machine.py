"""SPEC §2.2-§2.4, §3, §5, §8, §9: a governed request's job-level machine as a table of
state x event -> next state (core/machine.py). Pure: no store, no clock, no loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from idemproxy.constants import WAITER_RECHECK_SECONDS
from idemproxy.core.decision import Policy
from idemproxy.core.machine import (
    HELD_AT_SHUTDOWN,
    MAX_TURNS,
    About,
    JobGone,
    NeedAdmission,
    NeedAsk,
    NeedClaim,
    NeedClaimDropped,
    NeedForget,
    NeedHold,
    NeedLegacy,
    NeedLegacyForgotten,
    NeedLookup,
    NeedNextAdmission,
    NeedNextAttempt,
    NeedReread,
    NeedResend,
    NeedResendAdmission,
    NeedRun,
    NeedTakeOver,
    NeedWait,
    NeedWatch,
    Refused,
    Replaying,
    Rules,
    Seen,
    Terms,
    Unnamed,
    begin,
    over_quota,
    stand,
)
from idemproxy.core.quota import IN_FLIGHT, RATE, STORED_BYTES
from idemproxy.core.types import Claimed, Existing, Job, JobState, StoredResponse
from idemproxy.errors import (
    JobLost,
    OutcomeUnknown,
    PayloadMismatch,
    RequestInFlight,
    ShuttingDown,
    StoreUnavailable,
    TooManyWaiters,
)

FINGERPRINT = "f" * 64
NOW = 1000.0
MAX_WAIT = 30.0
DEADLINE = NOW + MAX_WAIT
RESPONSE = StoredResponse(status=201, headers=(), body=b"{}")
RULES = Rules(Policy(hold_in_flight=True), max_waiters_per_key=2, max_waiters=10, quotas=False)
IETF = replace(RULES, policy=Policy(hold_in_flight=False))
QUOTAS = replace(RULES, quotas=True)
TERMS = Terms(RULES, FINGERPRINT, MAX_WAIT)
LEGACY = Terms(RULES, FINGERPRINT, MAX_WAIT, legacy="legacy-owner")
# SPEC §3.6: a route whose upstream honours the key, one with a reconcile endpoint, one with both.
RESENDS = Terms(RULES, FINGERPRINT, MAX_WAIT, resends=True)
ASKS = Terms(RULES, FINGERPRINT, MAX_WAIT, asks=True)
BOTH = Terms(RULES, FINGERPRINT, MAX_WAIT, resends=True, asks=True)
NEXT_CHECK = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def job(
    state: JobState = JobState.IN_FLIGHT,
    *,
    id: str = "job-1",
    owner: str = "owner",
    fingerprint: str = FINGERPRINT,
    expired: bool = False,
    lease_expired: bool = False,
) -> Job:
    return Job(
        id=id,
        owner=owner,
        key="key-1",
        fingerprint=fingerprint,
        state=state,
        version=3,
        attempt_count=1,
        response=RESPONSE if state is JobState.COMPLETED else None,
        expired=expired,
        lease_expired=lease_expired,
    )


IN_FLIGHT_JOB = job()
COMPLETED = job(JobState.COMPLETED)
RELEASED = job(JobState.RELEASED)
UNKNOWN = job(JobState.UNKNOWN)
MISMATCHED = job(JobState.COMPLETED, fingerprint="0" * 64)
EXPIRED = job(JobState.COMPLETED, expired=True)
LEASE_EXPIRED = job(lease_expired=True)
LEGACY_JOB = job(JobState.COMPLETED, id="legacy-job", owner="legacy-owner")
OTHER = job(JobState.COMPLETED, id="job-2")
CLAIMED = Claimed(IN_FLIGHT_JOB, 1)
NEXT = Claimed(job(id="job-1"), 2)


def seen(
    found: Job = IN_FLIGHT_JOB,
    *,
    ran: str | None = None,
    turn: int = 1,
    asked: bool = False,
    next_check: datetime | None = None,
) -> Seen:
    return Seen(found, ran, DEADLINE, turn, asked, next_check)


def about(found: Job = IN_FLIGHT_JOB, ran: str | None = None) -> About:
    return About(ran or found.id, found.state.value)


HELD = seen()  # a request holding on the job in flight
RAN = seen(IN_FLIGHT_JOB, ran="job-1")  # a request whose attempt lost its CAS
LATER = NOW + 1.0
Step = Callable[[Any], object]

# (state, what its I/O gave, the next state). The events are calls of `next` (or `lost`).
TABLE: list[tuple[str, object, Step, object]] = [
    # --- the start ---
    ("begin", TERMS, lambda t: begin(t, False), NeedClaim(TERMS, None)),
    (
        "begin while draining: refused before any claim",
        TERMS,
        lambda t: begin(t, True),
        Refused(ShuttingDown, None, Unnamed.FIRST),
    ),
    (
        "begin with quotas: looked up first",
        replace(TERMS, rules=QUOTAS),
        lambda t: begin(t, False),
        NeedLookup(replace(TERMS, rules=QUOTAS), None),
    ),
    (
        "begin in the transition: the legacy owner's job first, whatever the drain",
        LEGACY,
        lambda t: begin(t, True),
        NeedLegacy(LEGACY, None),
    ),
    # --- SPEC §8: nothing new is claimed once a shutdown began ---
    (
        "draining: the first claim is refused",
        NeedAdmission(TERMS, None),
        lambda s: s.next(True),
        Refused(ShuttingDown, None, Unnamed.FIRST),
    ),
    (
        "draining: a claim afresh after a forget names no job",
        NeedAdmission(TERMS, HELD, no_job=True),
        lambda s: s.next(True),
        Refused(ShuttingDown, None, Unnamed.NO_JOB),
    ),
    (
        "draining: a claim after the job vanished names the job last read",
        NeedAdmission(TERMS, HELD),
        lambda s: s.next(True),
        Refused(ShuttingDown, None, about()),
    ),
    ("admitted", NeedAdmission(TERMS, None), lambda s: s.next(False), NeedClaim(TERMS, None)),
    (
        "admitted with quotas: looked up first (SPEC §9)",
        NeedAdmission(replace(TERMS, rules=QUOTAS), None),
        lambda s: s.next(False),
        NeedLookup(replace(TERMS, rules=QUOTAS), None),
    ),
    # --- SPEC §9: the lookup before a counted claim ---
    (
        "lookup: a duplicate is never refused, it replays",
        NeedLookup(TERMS, None),
        lambda s: s.next(COMPLETED, NOW),
        Replaying(seen(COMPLETED), RESPONSE),
    ),
    (
        "lookup: no job, claim within the quotas",
        NeedLookup(TERMS, None, no_job=True),
        lambda s: s.next(None, NOW),
        NeedClaim(TERMS, None, no_job=True),
    ),
    # --- SPEC §2.2: the claim ---
    (
        "claimed: run it, the deadline starts now",
        NeedClaim(TERMS, None),
        lambda s: s.next(CLAIMED, NOW),
        NeedRun(TERMS, seen(), CLAIMED),
    ),
    (
        "claim found a completed job: replay",
        NeedClaim(TERMS, None),
        lambda s: s.next(Existing(COMPLETED), NOW),
        Replaying(seen(COMPLETED), RESPONSE),
    ),
    (
        "claim found another payload: payload-mismatch about that job",
        NeedClaim(TERMS, None),
        lambda s: s.next(Existing(MISMATCHED), NOW),
        Refused(PayloadMismatch, None, about(MISMATCHED)),
    ),
    (
        "claim found an unknown job",
        NeedClaim(TERMS, None),
        lambda s: s.next(Existing(UNKNOWN), NOW),
        Refused(OutcomeUnknown, None, about(UNKNOWN)),
    ),
    (
        "claim found a job in flight: hold",
        NeedClaim(TERMS, None),
        lambda s: s.next(Existing(IN_FLIGHT_JOB), NOW),
        NeedHold(TERMS, seen()),
    ),
    (
        "ietf: a duplicate in flight is 409 at once",
        NeedClaim(replace(TERMS, rules=IETF), None),
        lambda s: s.next(Existing(IN_FLIGHT_JOB), NOW),
        Refused(RequestInFlight, None, about()),
    ),
    (
        "claim found a job whose lease ran out: take it over",
        NeedClaim(TERMS, None),
        lambda s: s.next(Existing(LEASE_EXPIRED), NOW),
        NeedTakeOver(TERMS, seen(LEASE_EXPIRED)),
    ),
    (
        "claim found a released job: start the next attempt",
        NeedClaim(TERMS, None),
        lambda s: s.next(Existing(RELEASED), NOW),
        NeedNextAdmission(TERMS, seen(RELEASED)),
    ),
    (
        "claim found an expired job: forget it",
        NeedClaim(TERMS, None),
        lambda s: s.next(Existing(EXPIRED), NOW),
        NeedForget(TERMS, seen(EXPIRED)),
    ),
    (
        "claimed in the transition: look for the legacy job again (SPEC §5)",
        NeedClaim(LEGACY, None),
        lambda s: s.next(CLAIMED, NOW),
        NeedLegacy(LEGACY, None, claimed=CLAIMED),
    ),
    (
        "claim afresh found a job: a later turn keeps the deadline",
        NeedClaim(TERMS, seen(turn=4)),
        lambda s: s.next(Existing(IN_FLIGHT_JOB), LATER),
        NeedHold(TERMS, seen(turn=5)),
    ),
    # --- SPEC §5: the legacy owner's job ---
    (
        "no legacy job: claim under the peppered owner",
        NeedLegacy(LEGACY, None),
        lambda s: s.next(None, NOW),
        NeedAdmission(LEGACY, None),
    ),
    (
        "a legacy job is the request's job",
        NeedLegacy(LEGACY, None),
        lambda s: s.next(LEGACY_JOB, NOW),
        Replaying(seen(LEGACY_JOB), RESPONSE),
    ),
    (
        "an expired legacy job is forgotten",
        NeedLegacy(LEGACY, None),
        lambda s: s.next(job(JobState.RELEASED, expired=True), NOW),
        NeedLegacyForgotten(LEGACY, None, False, job(JobState.RELEASED, expired=True), None),
    ),
    (
        "an expired legacy job in flight is never forgotten (SPEC §3.1)",
        NeedLegacy(LEGACY, None),
        lambda s: s.next(job(expired=True), NOW),
        NeedHold(LEGACY, seen(job(expired=True))),
    ),
    (
        "after the claim, still no legacy job: run the claimed one",
        NeedLegacy(LEGACY, None, claimed=CLAIMED),
        lambda s: s.next(None, NOW),
        NeedRun(LEGACY, seen(), CLAIMED),
    ),
    (
        "after the claim, a legacy job appeared: drop the claimed one",
        NeedLegacy(LEGACY, None, claimed=CLAIMED),
        lambda s: s.next(LEGACY_JOB, NOW),
        NeedClaimDropped(LEGACY, None, False, CLAIMED, LEGACY_JOB),
    ),
    (
        "after the claim, an expired legacy job: forgotten, then run the claimed one",
        NeedLegacy(LEGACY, None, claimed=CLAIMED),
        lambda s: s.next(EXPIRED, NOW),
        NeedLegacyForgotten(LEGACY, None, False, EXPIRED, CLAIMED),
    ),
    (
        "expired legacy job forgotten: claim",
        NeedLegacyForgotten(LEGACY, None, False, EXPIRED, None),
        lambda s: s.next(NOW),
        NeedAdmission(LEGACY, None),
    ),
    (
        "expired legacy job forgotten after the claim: run it",
        NeedLegacyForgotten(LEGACY, None, False, EXPIRED, CLAIMED),
        lambda s: s.next(NOW),
        NeedRun(LEGACY, seen(), CLAIMED),
    ),
    (
        "claimed job dropped: follow the legacy one",
        NeedClaimDropped(LEGACY, None, False, CLAIMED, LEGACY_JOB),
        lambda s: s.next(NOW),
        Replaying(seen(LEGACY_JOB), RESPONSE),
    ),
    # --- running the attempts, and a lost CAS ---
    (
        "the attempt lost its CAS: re-read, never run again",
        NeedRun(TERMS, seen(), CLAIMED),
        lambda s: s.lost(),
        NeedReread(TERMS, RAN),
    ),
    (
        "after a lost CAS: the winner's answer",
        NeedReread(TERMS, RAN),
        lambda s: s.next(COMPLETED, NOW),
        Replaying(seen(COMPLETED, ran="job-1", turn=2), RESPONSE),
    ),
    (
        "after a lost CAS: taken over, unknown",
        NeedReread(TERMS, RAN),
        lambda s: s.next(UNKNOWN, NOW),
        Refused(OutcomeUnknown, None, about(UNKNOWN, ran="job-1")),
    ),
    (
        "after a lost CAS: another job under the key (SPEC §3.3)",
        NeedReread(TERMS, RAN),
        lambda s: s.next(OTHER, NOW),
        JobGone("job-1", "job job-2 holds its key now", About("job-1", "completed")),
    ),
    (
        "after a lost CAS: the job was deleted",
        NeedReread(TERMS, RAN),
        lambda s: s.next(None, NOW),
        JobGone("job-1", "it was deleted", About("job-1", "in_flight")),
    ),
    (
        "after a lost CAS: released again by an operator",
        NeedReread(TERMS, RAN),
        lambda s: s.next(RELEASED, NOW),
        JobGone("job-1", "it is released again", About("job-1", "released")),
    ),
    (
        "after a lost CAS: expired",
        NeedReread(TERMS, RAN),
        lambda s: s.next(EXPIRED, NOW),
        JobGone("job-1", "it is completed again", About("job-1", "completed")),
    ),
    (
        "re-read: no job under the key, claim afresh",
        NeedReread(TERMS, HELD),
        lambda s: s.next(None, NOW),
        NeedAdmission(TERMS, HELD),
    ),
    (
        "re-read in the transition: no job, the legacy owner first",
        NeedReread(LEGACY, HELD),
        lambda s: s.next(None, NOW),
        NeedLegacy(LEGACY, HELD),
    ),
    # --- SPEC §3.5, §2.3, §3.1: acting on a job ---
    ("taken over: re-read", NeedTakeOver(TERMS, HELD), lambda s: s.next(), NeedReread(TERMS, HELD)),
    (
        "next attempt while draining: refused about the job",
        NeedNextAdmission(TERMS, seen(RELEASED)),
        lambda s: s.next(True),
        Refused(ShuttingDown, None, about(RELEASED)),
    ),
    (
        "next attempt admitted",
        NeedNextAdmission(TERMS, seen(RELEASED)),
        lambda s: s.next(False),
        NeedNextAttempt(TERMS, seen(RELEASED)),
    ),
    (
        "next attempt won its CAS: run it",
        NeedNextAttempt(TERMS, seen(RELEASED)),
        lambda s: s.next(NEXT, LATER),
        NeedRun(TERMS, seen(NEXT.job, turn=2), NEXT),
    ),
    (
        "next attempt lost its CAS: re-read",
        NeedNextAttempt(TERMS, seen(RELEASED)),
        lambda s: s.next(None, LATER),
        NeedReread(TERMS, seen(RELEASED)),
    ),
    (
        "forgotten: claim afresh, about no job",
        NeedForget(TERMS, seen(EXPIRED)),
        lambda s: s.next(),
        NeedAdmission(TERMS, seen(EXPIRED), no_job=True),
    ),
    (
        "forgotten in the transition: the legacy owner first",
        NeedForget(LEGACY, seen(EXPIRED)),
        lambda s: s.next(),
        NeedLegacy(LEGACY, seen(EXPIRED), no_job=True),
    ),
    # --- SPEC §2.3, §9: holding ---
    (
        "too many waiters on the key",
        NeedHold(TERMS, HELD),
        lambda s: s.next(2, 2),
        Refused(TooManyWaiters, None, about()),
    ),
    (
        "too many waiters in all",
        NeedHold(TERMS, HELD),
        lambda s: s.next(0, 10),
        Refused(TooManyWaiters, None, about()),
    ),
    ("held", NeedHold(TERMS, HELD), lambda s: s.next(1, 9), NeedWatch(TERMS, HELD)),
    (
        "still running: wait, at most the recheck interval",
        NeedWatch(TERMS, HELD),
        lambda s: s.next(IN_FLIGHT_JOB, NOW, False),
        NeedWait(TERMS, HELD, WAITER_RECHECK_SECONDS),
    ),
    (
        "still running near the deadline: wait what is left",
        NeedWait(TERMS, HELD, WAITER_RECHECK_SECONDS),
        lambda s: s.next(IN_FLIGHT_JOB, DEADLINE - 0.5, False),
        NeedWait(TERMS, HELD, 0.5),
    ),
    (
        "still running while draining: shutting-down about the job (SPEC §8)",
        NeedWait(TERMS, HELD, 1.0),
        lambda s: s.next(IN_FLIGHT_JOB, NOW, True),
        Refused(ShuttingDown, HELD_AT_SHUTDOWN, about()),
    ),
    (
        "still running at the deadline: request-in-flight",
        NeedWait(TERMS, HELD, 1.0),
        lambda s: s.next(IN_FLIGHT_JOB, DEADLINE, False),
        Refused(RequestInFlight, None, about()),
    ),
    (
        "the job completed while held: replay",
        NeedWatch(TERMS, HELD),
        lambda s: s.next(COMPLETED, NOW, True),
        Replaying(seen(COMPLETED, turn=2), RESPONSE),
    ),
    (
        "the held job's lease ran out: take it over",
        NeedWait(TERMS, HELD, 1.0),
        lambda s: s.next(LEASE_EXPIRED, NOW, False),
        NeedTakeOver(TERMS, seen(LEASE_EXPIRED, turn=2)),
    ),
    (
        "another job in flight under the key: decide on it",
        NeedWait(TERMS, HELD, 1.0),
        lambda s: s.next(job(id="job-2"), NOW, False),
        NeedHold(TERMS, seen(job(id="job-2"), turn=2)),
    ),
    (
        "the held job vanished: claim afresh",
        NeedWait(TERMS, HELD, 1.0),
        lambda s: s.next(None, NOW, False),
        NeedAdmission(TERMS, HELD),
    ),
    (
        "the held job vanished after this request's attempt lost its CAS",
        NeedWait(TERMS, RAN, 1.0),
        lambda s: s.next(None, NOW, False),
        JobGone("job-1", "it was deleted", about(ran="job-1")),
    ),
    # --- an unknown job that may resolve itself (SPEC §3.6) ---
    (
        "an unknown job on a route that resends: admitted first",
        NeedClaim(RESENDS, None),
        lambda s: s.next(Existing(UNKNOWN), NOW),
        NeedResendAdmission(RESENDS, seen(UNKNOWN, asked=True)),
    ),
    (
        "an unknown job on a route that only asks: ask",
        NeedClaim(ASKS, None),
        lambda s: s.next(Existing(UNKNOWN), NOW),
        NeedAsk(ASKS, seen(UNKNOWN, asked=True)),
    ),
    (
        "an unknown job on a route that resolves neither way: outcome-unknown",
        NeedClaim(TERMS, None),
        lambda s: s.next(Existing(UNKNOWN), NOW),
        Refused(OutcomeUnknown, None, about(UNKNOWN)),
    ),
    (
        "a request that ran an attempt never resends: it asks",
        NeedReread(BOTH, seen(ran="job-1")),
        lambda s: s.next(UNKNOWN, NOW),
        NeedAsk(BOTH, seen(UNKNOWN, ran="job-1", turn=2, asked=True)),
    ),
    (
        "a request that ran an attempt on a route that only resends: outcome-unknown",
        NeedReread(RESENDS, seen(ran="job-1")),
        lambda s: s.next(UNKNOWN, NOW),
        NeedReread(RESENDS, seen(UNKNOWN, ran="job-1", turn=2, asked=True)),
    ),
    (
        "asked once already: outcome-unknown, saying when it is next asked about",
        NeedReread(ASKS, seen(UNKNOWN, asked=True, next_check=NEXT_CHECK)),
        lambda s: s.next(UNKNOWN, NOW),
        Refused(OutcomeUnknown, None, about(UNKNOWN), NEXT_CHECK),
    ),
    (
        "asked once already, resolved meanwhile: replayed",
        NeedReread(ASKS, seen(UNKNOWN, asked=True)),
        lambda s: s.next(COMPLETED, NOW),
        Replaying(seen(COMPLETED, turn=2, asked=True), RESPONSE),
    ),
    (
        "draining: nothing is sent again; asked instead",
        NeedResendAdmission(BOTH, seen(UNKNOWN, asked=True)),
        lambda s: s.next(True),
        NeedAsk(BOTH, seen(UNKNOWN, asked=True)),
    ),
    (
        "draining on a route that only resends: read again",
        NeedResendAdmission(RESENDS, seen(UNKNOWN, asked=True)),
        lambda s: s.next(True),
        NeedReread(RESENDS, seen(UNKNOWN, asked=True)),
    ),
    (
        "not draining: try the resend",
        NeedResendAdmission(RESENDS, seen(UNKNOWN, asked=True)),
        lambda s: s.next(False),
        NeedResend(RESENDS, seen(UNKNOWN, asked=True)),
    ),
    (
        "the resend's CAS won: its attempt runs",
        NeedResend(RESENDS, seen(UNKNOWN, asked=True)),
        lambda s: s.next(NEXT, NOW),
        NeedRun(RESENDS, seen(NEXT.job, turn=2, asked=True), NEXT),
    ),
    (
        "no resend (refused or CAS lost), a reconcile endpoint: ask",
        NeedResend(BOTH, seen(UNKNOWN, asked=True)),
        lambda s: s.next(None, NOW),
        NeedAsk(BOTH, seen(UNKNOWN, asked=True)),
    ),
    (
        "no resend, no reconcile endpoint: read again",
        NeedResend(RESENDS, seen(UNKNOWN, asked=True)),
        lambda s: s.next(None, NOW),
        NeedReread(RESENDS, seen(UNKNOWN, asked=True)),
    ),
    (
        "asked: read again, with when the next question is due",
        NeedAsk(ASKS, seen(UNKNOWN, asked=True)),
        lambda s: s.next(NEXT_CHECK),
        NeedReread(ASKS, seen(UNKNOWN, asked=True, next_check=NEXT_CHECK)),
    ),
    (
        "the resend's attempt lost its CAS: never asked or sent again",
        NeedRun(RESENDS, seen(NEXT.job, asked=True), NEXT),
        lambda s: s.lost(),
        NeedReread(RESENDS, seen(NEXT.job, ran="job-1", asked=True)),
    ),
    # --- the guard against a loop that makes no progress ---
    (
        "the turn after the last one is request-in-flight",
        NeedReread(TERMS, seen(turn=MAX_TURNS)),
        lambda s: s.next(IN_FLIGHT_JOB, NOW),
        Refused(RequestInFlight, None, about()),
    ),
    (
        "the last turn still acts",
        NeedReread(TERMS, seen(turn=MAX_TURNS - 1)),
        lambda s: s.next(IN_FLIGHT_JOB, NOW),
        NeedHold(TERMS, seen(turn=MAX_TURNS)),
    ),
]


@pytest.mark.parametrize(
    ("state", "event", "expected"),
    [pytest.param(state, event, expected, id=name) for name, state, event, expected in TABLE],
)
def test_transition(state: object, event: Step, expected: object) -> None:
    assert event(state) == expected


def test_every_state_of_the_machine_is_in_the_table() -> None:
    starts = {type(state) for _, state, _, _ in TABLE} | {type(e) for *_, e in TABLE}
    needs = {
        NeedAdmission,
        NeedLookup,
        NeedClaim,
        NeedLegacy,
        NeedLegacyForgotten,
        NeedClaimDropped,
        NeedRun,
        NeedReread,
        NeedTakeOver,
        NeedNextAdmission,
        NeedNextAttempt,
        NeedForget,
        NeedResendAdmission,
        NeedResend,
        NeedAsk,
        NeedHold,
        NeedWatch,
        NeedWait,
        Replaying,
        Refused,
        JobGone,
    }
    assert needs <= starts


# --- SPEC §8: what a problem is about -----------------------------------------------------------


def test_a_problem_of_the_first_claim_is_left_as_it_is() -> None:
    problem = stand(StoreUnavailable(), Unnamed.FIRST)
    assert (problem.job_id, problem.job_state) == (None, None)


def test_a_problem_of_a_claim_afresh_names_no_job() -> None:
    problem = stand(StoreUnavailable(), NeedAdmission(TERMS, HELD, no_job=True).standing())
    assert (problem.job_id, problem.job_state) == (None, "none")


def test_a_problem_while_acting_names_the_job_last_read() -> None:
    problem = stand(StoreUnavailable(), NeedReread(TERMS, seen(RELEASED)).standing())
    assert (problem.job_id, problem.job_state) == ("job-1", "released")


def test_a_problem_after_a_lost_cas_names_the_job_that_ran() -> None:
    state = NeedReread(TERMS, seen(OTHER, ran="job-1"))
    problem = stand(StoreUnavailable(), state.standing())
    assert (problem.job_id, problem.job_state) == ("job-1", "completed")


def test_a_refusal_carries_its_detail_and_standing() -> None:
    error = Refused(ShuttingDown, HELD_AT_SHUTDOWN, about()).error()
    assert isinstance(error, ShuttingDown)
    assert error.detail == HELD_AT_SHUTDOWN
    assert (error.job_id, error.job_state) == ("job-1", "in_flight")


def test_a_lost_job_is_outcome_unknown_whatever_it_was_read_as() -> None:
    problem = stand(JobLost(), About("job-1", "completed"))
    assert (problem.job_id, problem.job_state) == ("job-1", "unknown")


@pytest.mark.parametrize(("limit", "retry_after"), [(IN_FLIGHT, 1), (RATE, 1), (STORED_BYTES, 60)])
def test_over_quota_says_which_limit_and_when_to_retry(limit: str, retry_after: int) -> None:
    problem = over_quota(limit)
    assert problem.retry_after == retry_after
    assert "Retry with the same Idempotency-Key" in problem.detail
