"""A governed request's life as state machines: at the job level (SPEC §2.2-§2.4, §3, §5, §8,
§9), and one attempt's steps with what its result means (SPEC §2.4, §3.2, §3.4; below the job
level's). Pure: no I/O, no clock, no asyncio.

Every state is a value; `state.next(...)` takes what the I/O of that state gave and returns the
next state (never changing the one it is called on). The states named `Need…` ask the driver
(proxy/jobs/governed.py) for one I/O step: a store call, the process's drain flag, a wait, the
attempts; the others end the request: `Replaying` (answer with the stored response), `Refused`
(answer with a problem), `JobGone` (this request's own job was lost under its attempt). What an
attempt does is the attempt's machine's, below; what to do with a job read is
core/decision.py's `decide`, which this machine applies.

`Terms` are what the request brings (its fingerprint, `max_wait`, the legacy owner of SPEC §5),
`Seen` what it learnt so far (the job it last read, the one whose attempt it ran, its deadline).
Each state knows what a problem raised while in it is about (`standing`, SPEC §8).

The values made per request (`Terms`, `Seen`, the states) are slotted dataclasses that nothing
assigns to once made, not frozen ones: a frozen dataclass sets each field through
`object.__setattr__`, and with them frozen a replay took 1.046 times main's instructions by
`bench/compare` (1.010 times as they are); `GovernedRequest` and `Job` are built the same way
for the same reason (bench/findings.md).
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, replace
from datetime import datetime
from typing import assert_never

from idemproxy.constants import WAITER_RECHECK_SECONDS
from idemproxy.core import decision
from idemproxy.core.decision import Policy, decide
from idemproxy.core.frozen import frozen
from idemproxy.core.quota import IN_FLIGHT, RATE, STORED_BYTES, retry_after
from idemproxy.core.states import EXPIRABLE
from idemproxy.core.types import Claimed, ClaimResult, Existing, Job, JobState, KeptResponse
from idemproxy.errors import (
    ContractViolation,
    ProblemError,
    QuotaExceeded,
    RequestInFlight,
    ShuttingDown,
    TooManyWaiters,
    UpstreamTimeout,
    UpstreamUnavailable,
)

# Every turn makes progress (a state changed or time passed); this only guards against a bug.
MAX_TURNS = 32
HELD_AT_SHUTDOWN = (
    "The proxy is shutting down; the request with this key is still in flight. Retry with the "
    "same Idempotency-Key to get its result."
)
_QUOTA_DETAIL = {
    IN_FLIGHT: "This owner has as many requests in flight as its quota allows; nothing was "
    "claimed or forwarded. Retry with the same Idempotency-Key after Retry-After.",
    RATE: "This owner started as many new requests this second as its quota allows; nothing "
    "was claimed or forwarded. Retry with the same Idempotency-Key after Retry-After.",
    STORED_BYTES: "This owner's stored responses fill its quota; nothing was claimed or "
    "forwarded. Retry with the same Idempotency-Key after Retry-After.",
}


def over_quota(limit: str) -> QuotaExceeded:
    """SPEC §9: the answer to a new job refused by quota `limit`, before anything was claimed."""
    return QuotaExceeded(_QUOTA_DETAIL[limit], retry_after=retry_after(limit))


# --- what a request brings and what it learnt ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rules:
    """The process's rules for every governed request (its settings)."""

    policy: Policy
    max_waiters_per_key: int  # SPEC §9: held duplicates of one job, and in all
    max_waiters: int
    quotas: bool  # SPEC §9: a new key is looked up, then claimed within the owner's quotas


@dataclass(slots=True)
class Terms:
    """What one request brings: its fingerprint (SPEC §6), how long it may be held (`max_wait`
    of its route) and, in the transition to `owner.pepper`, its legacy owner (SPEC §5)."""

    rules: Rules
    fingerprint: str
    max_wait: float
    legacy: str | None = None
    # SPEC §3.6: what the request's route can do about an `unknown` job: send it again under
    # the key its upstream honours (`resends`), ask its reconcile endpoint (`asks`).
    resends: bool = False
    asks: bool = False
    # SPEC §6: the fingerprint the request had before `fingerprint_headers` was set, which a job
    # stored then still matches (`Intent.earlier_fingerprint`).
    earlier_fingerprint: str | None = None


@dataclass(slots=True)
class Seen:
    """What a request learnt once its first claim answered: the job it last read (reads go under
    that job's owner, SPEC §5), the one it ran an attempt of once that attempt lost its CAS
    (`ran`: from then on it answers only from that job and never claims or starts an attempt
    again, one request, one execution at most), its hold deadline (by the driver's clock) and
    how many results it has acted on."""

    job: Job
    ran: str | None
    deadline: float
    turn: int
    # SPEC §3.6: this request asked about its `unknown` job already (once per request), and
    # when the reconcile endpoint is next asked about it, if it will be.
    asked: bool = False
    next_check: datetime | None = None


class Unnamed(enum.Enum):
    """What a problem raised before the request has a job is about (SPEC §8)."""

    FIRST = "first"  # its first claim: nothing to add (and a store failure may pass it through)
    NO_JOB = "no_job"  # a claim afresh after its job was forgotten: not the job that is gone


@dataclass(frozen=True, slots=True)
class About:
    """A problem is about this job, in this state as last read (SPEC §8)."""

    job_id: str
    state: str


Standing = About | Unnamed


def stand(problem: ProblemError, standing: Standing) -> ProblemError:
    """`problem`, saying what it is about (SPEC §8: `instance`, `job_state`)."""
    if isinstance(standing, About):
        return problem.about(standing.job_id, standing.state)
    if standing is Unnamed.NO_JOB:
        return problem.about_no_job()
    return problem


def _about(seen: Seen) -> About:
    return About(seen.ran or seen.job.id, seen.job.state.value)


# --- the end of a request -----------------------------------------------------------------------


@dataclass(slots=True)
class Replaying:
    """Answer with the job's stored response (SPEC §7), opened first when sealed (§11)."""

    seen: Seen
    response: KeptResponse

    def standing(self) -> Standing:
        return _about(self.seen)


@dataclass(slots=True)
class Refused:
    """Answer with `problem` (its `detail`, if given); nothing goes upstream."""

    problem: type[ProblemError]
    detail: str | None
    about: Standing
    # SPEC §3.6, §8: when a still-unknown job is next asked about (Retry-After, next_check_at).
    next_check: datetime | None = None

    def error(self) -> ProblemError:
        error = self.problem(self.detail) if self.detail is not None else self.problem()
        return stand(error, self.about)

    def standing(self) -> Standing:
        return self.about


@dataclass(slots=True)
class JobGone:
    """SPEC §3.3: the job this request ran an attempt of was deleted or resolved under that
    attempt, whose outcome could not be stored: 409 outcome-unknown (JobLost), never run again."""

    job_id: str
    why: str
    about: Standing

    def standing(self) -> Standing:
        return self.about


# --- claiming (SPEC §2.2, §5, §9) ---------------------------------------------------------------


@dataclass(slots=True)
class NeedAdmission:
    """Read the drain flag: once a shutdown began nothing new is claimed (SPEC §8)."""

    terms: Terms
    seen: Seen | None  # None: the request's first claim
    no_job: bool = False  # a claim afresh after the job under the key was forgotten

    def next(self, draining: bool) -> State:
        return _admitted(self.terms, self.seen, self.no_job, draining)

    def standing(self) -> Standing:
        return _claim_standing(self.seen, self.no_job)


def _admitted(terms: Terms, seen: Seen | None, no_job: bool, draining: bool) -> State:
    if draining:
        return Refused(ShuttingDown, None, _claim_standing(seen, no_job))
    if terms.rules.quotas:
        return NeedLookup(terms, seen, no_job)
    return NeedClaim(terms, seen, no_job)


@dataclass(slots=True)
class NeedLookup:
    """SPEC §9: look the key up before counting a new job against the owner's quotas: a key
    that has a job is a duplicate, read as a claim would read it, never refused."""

    terms: Terms
    seen: Seen | None
    no_job: bool = False

    def next(self, found: Job | None, now: float) -> State:
        if found is not None:
            return _turn(self.terms, self.seen, found, now)
        return NeedClaim(self.terms, self.seen, self.no_job)

    def standing(self) -> Standing:
        return _claim_standing(self.seen, self.no_job)


@dataclass(slots=True)
class NeedClaim:
    """Claim the key (SPEC §2.2): within the owner's quotas when there are any (SPEC §9; a
    refusal is `over_quota`'s problem), under the peppered owner in the transition (SPEC §5)."""

    terms: Terms
    seen: Seen | None
    no_job: bool = False

    def next(self, result: ClaimResult, now: float) -> State:
        if isinstance(result, Existing):
            return _turn(self.terms, self.seen, result.job, now)
        if self.terms.legacy is not None:
            # SPEC §5: a proxy without the pepper may have claimed the legacy key meanwhile.
            return NeedLegacy(self.terms, self.seen, self.no_job, result)
        return _turn(self.terms, self.seen, result, now)

    def standing(self) -> Standing:
        return _claim_standing(self.seen, self.no_job)


@dataclass(slots=True)
class NeedLegacy:
    """SPEC §5, `owner.legacy_owners`: read the job under the legacy owner. Such a job is this
    request's (replayed, held, retried under that owner), never claimed afresh beside it: looked
    for before every claim, and again after a claim that created a job (`claimed`)."""

    terms: Terms
    seen: Seen | None
    no_job: bool = False
    claimed: Claimed | None = None

    def next(self, found: Job | None, now: float) -> State:
        if found is not None and found.expired and found.state in EXPIRABLE:
            # SPEC §3.1: gone, whatever the sweeper has not deleted yet; forgotten, so that a
            # new job is claimed under the peppered owner, not the legacy one.
            return NeedLegacyForgotten(self.terms, self.seen, self.no_job, found, self.claimed)
        if found is not None:
            if self.claimed is None:
                return _turn(self.terms, self.seen, found, now)
            return NeedClaimDropped(self.terms, self.seen, self.no_job, self.claimed, found)
        if self.claimed is None:
            return NeedAdmission(self.terms, self.seen, self.no_job)
        return _turn(self.terms, self.seen, self.claimed, now)

    def standing(self) -> Standing:
        return _claim_standing(self.seen, self.no_job)


@dataclass(slots=True)
class NeedLegacyForgotten:
    """Forget the expired legacy job (CAS on its version), then go on as if there was none."""

    terms: Terms
    seen: Seen | None
    no_job: bool
    job: Job
    claimed: Claimed | None

    def next(self, now: float) -> State:
        if self.claimed is None:
            return NeedAdmission(self.terms, self.seen, self.no_job)
        return _turn(self.terms, self.seen, self.claimed, now)

    def standing(self) -> Standing:
        return _claim_standing(self.seen, self.no_job)


@dataclass(slots=True)
class NeedClaimDropped:
    """SPEC §5: the job just claimed, forwarded nowhere yet, is deleted (a duplicate held on it
    wakes, claims again and finds the legacy job too); the request follows the legacy one."""

    terms: Terms
    seen: Seen | None
    no_job: bool
    claimed: Claimed
    legacy_job: Job

    def next(self, now: float) -> State:
        return _turn(self.terms, self.seen, self.legacy_job, now)

    def standing(self) -> Standing:
        return _claim_standing(self.seen, self.no_job)


def _claim_standing(seen: Seen | None, no_job: bool) -> Standing:
    if seen is None:
        return Unnamed.FIRST
    return Unnamed.NO_JOB if no_job else _about(seen)


def _claim_afresh(terms: Terms, seen: Seen, *, no_job: bool) -> State:
    if terms.legacy is not None:
        return NeedLegacy(terms, seen, no_job)
    return NeedAdmission(terms, seen, no_job)


# --- acting on a job (SPEC §2.3) ----------------------------------------------------------------


def _turn(terms: Terms, seen: Seen | None, result: Job | Claimed, now: float) -> State:
    """One result acted on: a job this request claimed (run it) or found (decide)."""
    turn = 1 if seen is None else seen.turn + 1
    if seen is not None and turn > MAX_TURNS:
        return Refused(RequestInFlight, None, _about(seen))
    deadline = now + terms.max_wait if seen is None else seen.deadline
    ran = None if seen is None else seen.ran
    asked, next_check = (False, None) if seen is None else (seen.asked, seen.next_check)
    if isinstance(result, Claimed):
        return NeedRun(terms, Seen(result.job, ran, deadline, turn, asked, next_check), result)
    job = result
    now_seen = Seen(job, ran, deadline, turn, asked, next_check)
    if ran is not None and job.id != ran:
        # An operator deleted this request's job (and a retry claimed the key afresh).
        return JobGone(ran, f"job {job.id} holds its key now", _about(now_seen))
    return _act(terms, now_seen, now)


def _act(terms: Terms, seen: Seen, now: float) -> State:
    job = seen.job
    wait_expired = now >= seen.deadline
    ask = (terms.resends or terms.asks) and not seen.asked
    outcome = decide(
        job,
        terms.fingerprint,
        terms.rules.policy,
        wait_expired=wait_expired,
        ask=ask,
        earlier=terms.earlier_fingerprint,
    )
    # Class patterns without captures: a capture makes CPython build a set of the attribute
    # names (match_class), on every replay.
    match outcome:
        case decision.Replay():
            return Replaying(seen, outcome.response)
        case decision.Reject():
            return Refused(outcome.problem, None, _about(seen), seen.next_check)
        case decision.Hold():
            return NeedHold(terms, seen)
        case decision.TakeOver():
            return NeedTakeOver(terms, seen)
        case decision.StartNextAttempt():
            if seen.ran is not None:
                return _ran_already(seen)
            return NeedNextAdmission(terms, seen)
        case decision.Forget():
            if seen.ran is not None:
                return _ran_already(seen)
            return NeedForget(terms, seen)
        case decision.AskAbout():
            return _ask_about(terms, replace(seen, asked=True))
        case _:
            assert_never(outcome)


def _ran_already(seen: Seen) -> JobGone:
    """Released (an operator resolved the job taken over from under this request's attempt) or
    expired: running it again would be this request's second execution."""
    return JobGone(seen.job.id, f"it is {seen.job.state.value} again", _about(seen))


def _read(terms: Terms, seen: Seen, found: Job | None, now: float) -> State:
    """The job under the key now; none: claim it afresh, unless this request ran an attempt of
    the job that was there (an operator deleted it under that attempt, whose outcome could not
    be stored): a claim now would execute the request a second time."""
    if found is not None:
        return _turn(terms, seen, found, now)
    if seen.ran is not None:
        return JobGone(seen.ran, "it was deleted", _about(seen))
    return _claim_afresh(terms, seen, no_job=False)


@dataclass(slots=True)
class NeedRun:
    """Run the attempts of the job this request claimed (proxy/jobs/governed.py). They answer the
    client, or `lost()`: another attempt won the completion CAS, and the winner's answer is
    read from the job."""

    terms: Terms
    seen: Seen
    claimed: Claimed

    def lost(self) -> NeedReread:
        return NeedReread(self.terms, replace(self.seen, ran=self.claimed.job.id))

    def standing(self) -> Standing:
        return _about(self.seen)


@dataclass(slots=True)
class _OnJob:
    """A step of a request that has read its job: what the request brings and has learnt; a
    problem raised in it is about the job last read (SPEC §8)."""

    terms: Terms
    seen: Seen

    def standing(self) -> Standing:
        return _about(self.seen)


@dataclass(slots=True)
class NeedReread(_OnJob):
    """Read the job under the key (under the owner of the job last read, SPEC §5)."""

    def next(self, found: Job | None, now: float) -> State:
        return _read(self.terms, self.seen, found, now)


@dataclass(slots=True)
class NeedTakeOver(_OnJob):
    """SPEC §3.5: CAS the job whose lease ran out to `unknown`; winners and losers alike re-read."""

    def next(self) -> NeedReread:
        return NeedReread(self.terms, self.seen)


@dataclass(slots=True)
class NeedNextAdmission(_OnJob):
    """Read the drain flag before starting the next attempt of a released job (SPEC §8)."""

    def next(self, draining: bool) -> State:
        if draining:
            return Refused(ShuttingDown, None, _about(self.seen))
        return NeedNextAttempt(self.terms, self.seen)


@dataclass(slots=True)
class NeedNextAttempt(_OnJob):
    """SPEC §2.3: try to win the CAS that starts the next attempt of the released job; a lost
    CAS (None) re-reads the job."""

    def next(self, claimed: Claimed | None, now: float) -> State:
        if claimed is None:
            return NeedReread(self.terms, self.seen)
        return _turn(self.terms, self.seen, claimed, now)


@dataclass(slots=True)
class NeedForget(_OnJob):
    """SPEC §3.1, §11: delete the expired job by CAS on its version, then claim the key afresh."""

    def next(self) -> State:
        return _claim_afresh(self.terms, self.seen, no_job=True)


# --- an `unknown` job that may resolve itself (SPEC §3.6) -----------------------------------------


def _ask_about(terms: Terms, seen: Seen) -> State:
    """The request's one question about its `unknown` job: sent again under the key its upstream
    honours, unless this request ran an attempt already (it never runs a second); else asked
    about at the reconcile endpoint; then the job is read and decided on again."""
    if terms.resends and seen.ran is None:
        return NeedResendAdmission(terms, seen)
    return _after_resend(terms, seen)


def _after_resend(terms: Terms, seen: Seen) -> State:
    return NeedAsk(terms, seen) if terms.asks else NeedReread(terms, seen)


@dataclass(slots=True)
class NeedResendAdmission(_OnJob):
    """Read the drain flag: once a shutdown began, nothing is sent again (SPEC §8)."""

    def next(self, draining: bool) -> State:
        if draining:
            return _after_resend(self.terms, self.seen)
        return NeedResend(self.terms, self.seen)


@dataclass(slots=True)
class NeedResend(_OnJob):
    """SPEC §3.6: send the request again as a new attempt of the `unknown` job, when
    core/resolution.py `may_resend` allows it and this request wins the store's CAS: its
    attempt runs (`NeedRun`); else (None) the reconcile endpoint may still be asked."""

    def next(self, resent: Claimed | None, now: float) -> State:
        if resent is None:
            return _after_resend(self.terms, self.seen)
        return _turn(self.terms, self.seen, resent, now)


@dataclass(slots=True)
class NeedAsk(_OnJob):
    """SPEC §3.6: ask the route's reconcile endpoint about the job, if a question is due; then
    read the job again. `next_check`: when the next question is due, if the job is still
    `unknown` (the answer to a retry says so)."""

    def next(self, next_check: datetime | None) -> NeedReread:
        return NeedReread(self.terms, replace(self.seen, next_check=next_check))


# --- holding a duplicate (SPEC §2.3, §8, §9) ----------------------------------------------------


@dataclass(slots=True)
class NeedHold(_OnJob):
    """Count the requests held already: beyond a limit, 503 too-many-waiters (SPEC §9)."""

    def next(self, waiting_for_job: int, waiting: int) -> Refused | NeedWatch:
        rules = self.terms.rules
        if waiting_for_job >= rules.max_waiters_per_key or waiting >= rules.max_waiters:
            return Refused(TooManyWaiters, None, _about(self.seen))
        return NeedWatch(self.terms, self.seen)


@dataclass(slots=True)
class NeedWatch(_OnJob):
    """Subscribe to the job's changes, then read it (after subscribing, so that a change just
    before cannot be missed); hold, without a pooled connection, until it leaves `in_flight`,
    its lease runs out or the deadline passes."""

    def next(self, found: Job | None, now: float, draining: bool) -> NeedWait | State:
        return _watched(self.terms, self.seen, found, now, draining)


@dataclass(slots=True)
class NeedWait:
    """Wait up to `seconds` for a change of the job, then read it again."""

    terms: Terms
    seen: Seen
    seconds: float

    def next(self, found: Job | None, now: float, draining: bool) -> NeedWait | State:
        return _watched(self.terms, self.seen, found, now, draining)

    def standing(self) -> Standing:
        return _about(self.seen)


def _watched(
    terms: Terms, seen: Seen, found: Job | None, now: float, draining: bool
) -> NeedWait | State:
    held = seen.job
    still_running = (
        found is not None
        and found.id == held.id
        and found.state is JobState.IN_FLIGHT
        and not found.lease_expired
    )
    if still_running:
        if draining:  # SPEC §8: an answer now, not a disconnect at the drain's end
            return Refused(ShuttingDown, HELD_AT_SHUTDOWN, _about(seen))
        remaining = seen.deadline - now
        if remaining > 0:
            return NeedWait(terms, seen, min(remaining, WAITER_RECHECK_SECONDS))
    return _read(terms, seen, found, now)


def begin(terms: Terms, draining: bool) -> State:
    """The first state of a governed request: its claim, admitted by the drain flag as read now
    (or, in the transition, once the legacy owner has no job)."""
    if terms.legacy is not None:
        return NeedLegacy(terms, None)
    return _admitted(terms, None, False, draining)


# Every state of the main loop; a hold's own (NeedWatch, NeedWait) stay inside the hold.
State = (
    NeedAdmission
    | NeedLookup
    | NeedClaim
    | NeedLegacy
    | NeedLegacyForgotten
    | NeedClaimDropped
    | NeedRun
    | NeedReread
    | NeedTakeOver
    | NeedNextAdmission
    | NeedNextAttempt
    | NeedForget
    | NeedResendAdmission
    | NeedResend
    | NeedAsk
    | NeedHold
    | Replaying
    | Refused
    | JobGone
)


# One attempt: what its result means, and its life as a pure machine (SPEC §2.4, §3.2, §3.4, §7).
#
# * `classify_response`, `classify_failure`, `classify_breach` and `classify_cut_off` give the
#   outcome of an attempt (complete, release, unknown) for what its upstream did; `settled_state`
#   the job state a failed outcome settles the job in;
# * `handed_back` and `response_handling` say, by the attempt's `Mode`, whether its caller decides
#   what a failed outcome does to the job, and how the response is carried on.
#
# The machine: each state is a frozen dataclass (core/frozen.py); `state.next(event)` gives the
# next one. A state that needs I/O is a command that the driver (proxy/jobs/governed.py) carries
# out before feeding back what happened:
#
#     Forward --Head--> KeepReply | HandBack | Stream | Capture
#     Forward --TransportFailed--> HandBack | Settle --> AnswerProblem (`fail`)
#     Capture --BodyCaptured--> CheckContract | Complete | Settle | StreamThrough
#     CheckContract --Checked--> `fail` (a breach) | as Capture without the check
#     Stream, StreamThrough --BodyEnded | BodyCut--> Complete | Settle | Finish | Abort
#     Complete --won--> then | Lost;  Settle --> then
#
# `Complete` and `Settle` carry the state that follows them (`then`) and whether the response's
# head went out already (`after_head`): then a store error is not the client's answer (SPEC §7,
# one response per request), and a lost completion CAS changes nothing that was sent. The
# terminal states (`Answer`, `Finish`, `Abort`, `AnswerProblem`, `HandBack`, `KeepReply`, `Lost`)
# say what the attempt ends with. A job's attempts across its upstream group (fail-over, the
# hedged race) are core/attempt_order.py's. No I/O, no clock, no asyncio here.


class Outcome(enum.Enum):
    """What an attempt's result does to its job (SPEC §3.2)."""

    COMPLETE = "complete"  # attempt succeeded, job completed, response stored
    RELEASE = "release"  # attempt failed, nothing executed, job released
    UNKNOWN = "unknown"  # the upstream may or may not have executed


class Failure(enum.Enum):
    """Transport failures, by how far the request got (SPEC §3.2)."""

    CONNECT = "connect"  # refused, DNS, TLS: no byte of the request was written
    TIMEOUT = "timeout"  # no (complete) response in time after the request was sent
    BROKEN = "broken"  # reset, malformed response or body cut off after the request was sent


class Mode(enum.Enum):
    """Where an attempt stands among the attempts of its job (SPEC §3.4)."""

    FINAL = "final"  # the last option: settle the job whatever happens
    FAIL_OVER = "fail-over"  # a released outcome goes to the next upstream
    HEDGED = "hedged"  # other attempts race: report failures, buffer the response


class Handling(enum.Enum):
    """How an upstream's response is carried on once its head arrived (SPEC §3.4, §7)."""

    HAND_BACK = "hand-back"  # a failure for the caller; the next upstream answers, not this body
    HAND_BACK_WITH_REPLY = "hand-back-with-reply"  # a failed racer: its answer kept for the race
    STREAM = "stream"  # a stream of events: to the client as it arrives, stored at its end
    CAPTURE = "capture"  # read up to max_stored_body (and checked against a contract), then on


@dataclass(frozen=True, slots=True)
class StatusPolicy:
    release_statuses: Collection[int]
    unknown_statuses: Collection[int]


def classify_response(status: int, policy: StatusPolicy) -> Outcome:
    if status in policy.release_statuses:
        return Outcome.RELEASE  # SPEC §3.2: the upstream says it did not process it
    if status in policy.unknown_statuses:
        return Outcome.UNKNOWN  # SPEC §3.2: a gateway further down may have executed it
    return Outcome.COMPLETE


def classify_failure(failure: Failure) -> tuple[Outcome, type[ProblemError]]:
    """The job outcome and the first client's answer for a transport failure."""
    match failure:
        case Failure.CONNECT:
            return Outcome.RELEASE, UpstreamUnavailable
        case Failure.TIMEOUT:
            return Outcome.UNKNOWN, UpstreamTimeout
        case Failure.BROKEN:
            return Outcome.UNKNOWN, UpstreamUnavailable
        case _:
            assert_never(failure)


def classify_breach() -> tuple[Outcome, type[ProblemError]]:
    """A 2xx that breaks the route's response contract, or is too large to check against it
    (SPEC §3.4): a 2xx proves the upstream acted, so the job is unknown, never released or
    failed over (running it again would execute it twice) and never completed with a response
    the contract refuses."""
    return Outcome.UNKNOWN, ContractViolation


def classify_cut_off() -> Outcome:
    """An attempt cut off once its request may have reached the upstream: by shutdown, or by
    its response body breaking off after the head (SPEC §3.2). The upstream may have executed
    it, whatever broke."""
    return Outcome.UNKNOWN


def handed_back(outcome: Outcome, mode: Mode) -> bool:
    """Whether the caller decides what a failed outcome does to the job (SPEC §3.4): a released
    one may fail over; in a race every failure waits for the other attempts. An unknown outcome
    never fails over."""
    if outcome is Outcome.COMPLETE:
        return False
    return mode is Mode.HEDGED or (mode is Mode.FAIL_OVER and moves_on(outcome))


def response_handling(outcome: Outcome, mode: Mode, *, event_stream: bool, gated: bool) -> Handling:
    """How a response is carried on, by its outcome and the attempt's mode.

    A failure handed back in a race keeps the upstream's answer: it may be the last one the
    race gets (SPEC §3.2). A stream of events (`event_stream`) reaches its client as it arrives
    (SPEC §2 step 4), but not in a race, whose winner must be decided before a byte goes out,
    and not behind a contract gate (`gated`), which needs the whole body (SPEC §3.4)."""
    if handed_back(outcome, mode):
        return Handling.HAND_BACK_WITH_REPLY if mode is Mode.HEDGED else Handling.HAND_BACK
    if event_stream and mode is not Mode.HEDGED and not gated:
        return Handling.STREAM
    return Handling.CAPTURE


def checks_contract(outcome: Outcome) -> bool:
    """SPEC §3.4: on a route whose group has a contract, only a response that would complete
    the job is checked against it; a released or unknown one is not stored, so there is
    nothing to refuse."""
    return outcome is Outcome.COMPLETE


def completes_before_head(outcome: Outcome, mode: Mode) -> bool:
    """In a race, the attempt must win the completion CAS before a byte reaches the client
    (SPEC §7, one response per request): a body too large to keep completes the job first, as
    omitted. Elsewhere it completes once the body went out whole."""
    return mode is Mode.HEDGED and outcome is Outcome.COMPLETE


# RFC 9110 §15.5.9 408, §15.5.10 409 (Stripe and others: the first request is still being
# processed), RFC 8470 425, RFC 6585 429: none says what became of the first request.
_RESEND_IN_PROGRESS = frozenset({408, 409, 425, 429})


def resend_outcome(status: int | None) -> Outcome:
    """What the upstream's answer to a request sent again under the key it honours does to the
    job (SPEC §3.6): a final answer is the one the key stands for (executed now or before, the
    upstream's guarantee) and completes it; a timeout, a reset (`None`), an answer that the
    first one is still in progress, a refusal to take it now or a 5xx proves nothing and leaves
    it unknown, never released: an earlier attempt may have executed, whatever this one did."""
    if status is None or status in _RESEND_IN_PROGRESS or status >= 500:
        return Outcome.UNKNOWN
    return Outcome.COMPLETE


def settled_state(outcome: Outcome) -> JobState:
    """The state a failed outcome settles its job in (SPEC §3.1, §3.2)."""
    match outcome:
        case Outcome.RELEASE:
            return JobState.RELEASED
        case Outcome.UNKNOWN:
            return JobState.UNKNOWN
        case Outcome.COMPLETE:
            raise ValueError("a complete outcome completes its job, it does not settle it")
        case _:
            assert_never(outcome)


def order_mode(index: int, upstreams: int) -> Mode:
    """The mode of the attempt on the `index`-th of `upstreams` tried in order (SPEC §3.4): the
    last one settles the job, every other may fail over."""
    return Mode.FINAL if index == upstreams - 1 else Mode.FAIL_OVER


def moves_on(outcome: Outcome) -> bool:
    """Whether another attempt may start after this one (SPEC §3.4): only after an outcome that
    proves nothing executed, a release."""
    return outcome is Outcome.RELEASE


# --- the machine of one attempt -------------------------------------------------------------------


@frozen
class Failed:
    """An attempt that ended without a result to complete its job with (SPEC §3.2)."""

    outcome: Outcome
    status: int | None
    error: str | None
    problem: type[ProblemError] = UpstreamUnavailable


class Body(enum.Enum):
    """What a completion stores of the response's body (SPEC §7)."""

    KEPT = "kept"  # the body as captured (or teed), if it was whole
    OMITTED = "omitted"  # over max_stored_body: stored without it


# --- events -------------------------------------------------------------------------------------


@frozen
class Head:
    """The upstream's response head arrived."""

    status: int
    event_stream: bool  # a stream of events (server-sent events, NDJSON)


@frozen
class TransportFailed:
    """No response head: refused, timed out, reset (SPEC §3.2)."""

    failure: Failure
    reason: str


@frozen
class BodyCaptured:
    """The body was read up to max_stored_body: `whole` if all of it fit."""

    whole: bool


@frozen
class Checked:
    """The captured response was checked against the route's contract (SPEC §3.4)."""

    violations: tuple[str, ...]


@frozen
class BodyEnded:
    """The rest of the body reached the client whole."""


@frozen
class BodyCut:
    """The upstream's body broke off after the head went to the client (SPEC §3.2)."""

    reason: str


# --- terminal states ----------------------------------------------------------------------------


@frozen
class Answer:
    """Send the captured response to the client as a whole."""


@frozen
class Finish:
    """End the response already streaming to the client."""


@frozen
class Abort:
    """Cut the client's connection: its response started and cannot end well (SPEC §7)."""


@frozen
class AnswerProblem:
    """The job is settled: answer with the problem of `failed` (SPEC §3.2)."""

    failed: Failed


@frozen
class HandBack:
    """The caller decides what the failure does to the job (SPEC §3.4); the body is not needed."""

    failed: Failed


@frozen
class KeepReply:
    """Hand back in a race, with the upstream's answer kept: it may be the last one the race
    gets (SPEC §3.2)."""

    failed: Failed


@frozen
class Lost:
    """Another attempt won the completion CAS: this result is discarded (SPEC §1)."""


# --- command states -----------------------------------------------------------------------------


@frozen
class Complete:
    """Command: the completion CAS with the response, its body `body`."""

    body: Body
    after_head: bool
    then: AttemptState

    def next(self, won: bool | None) -> AttemptState:
        """`won` is None when the store could not be reached after the head went out: the
        outcome is kept to write later, and the response is on its way whatever the CAS says
        (SPEC §7)."""
        return self.then if won or self.after_head else Lost()


@frozen
class Settle:
    """Command: settle the job as `failed` says (SPEC §3.2); a lost CAS is only logged."""

    failed: Failed
    after_head: bool
    then: AttemptState

    def next(self) -> AttemptState:
        return self.then


def fail(failed: Failed, mode: Mode) -> HandBack | Settle:
    """No response to pass on: hand it back, or settle the job and answer its problem."""
    if handed_back(failed.outcome, mode):
        return HandBack(failed)
    return Settle(failed, after_head=False, then=AnswerProblem(failed))


@frozen
class Forward:
    """Command: send the request upstream; wait for the head of its response."""

    mode: Mode
    gated: bool  # the route's group has a response contract (SPEC §3.4)
    statuses: StatusPolicy
    # SPEC §3.6: the request sent again under the key its upstream honours, after an attempt
    # whose outcome is unknown: `resend_outcome` overrides the statuses' classification.
    resend: bool = False

    def next(self, event: Head | TransportFailed) -> AttemptState:
        if isinstance(event, TransportFailed):
            outcome, problem = classify_failure(event.failure)
            if self.resend:
                outcome = resend_outcome(None)
            return fail(Failed(outcome, None, event.reason, problem), self.mode)
        if self.resend:
            outcome = resend_outcome(event.status)
        else:
            outcome = classify_response(event.status, self.statuses)
        handling = response_handling(
            outcome, self.mode, event_stream=event.event_stream, gated=self.gated
        )
        if handling is Handling.CAPTURE:
            check = self.gated and checks_contract(outcome)
            return Capture(outcome, event.status, self.mode, check)
        if handling is Handling.STREAM:
            return Stream(outcome, event.status)
        failed = Failed(outcome, event.status, None)
        return KeepReply(failed) if handling is Handling.HAND_BACK_WITH_REPLY else HandBack(failed)


@frozen
class Capture:
    """Command: read the body up to max_stored_body (SPEC §7)."""

    outcome: Outcome
    status: int
    mode: Mode
    check: bool  # against the route's contract, before anything is stored or sent

    def next(self, event: BodyCaptured) -> AttemptState:
        if self.check:
            return CheckContract(self.outcome, self.status, self.mode, event.whole)
        return _captured(self.outcome, self.status, self.mode, event.whole)


@frozen
class CheckContract:
    """Command: check the captured response against the route's contract (SPEC §3.4)."""

    outcome: Outcome
    status: int
    mode: Mode
    whole: bool

    def next(self, event: Checked) -> AttemptState:
        if event.violations:
            # The upstream acted: unknown, never released (SPEC §3.4).
            outcome, problem = classify_breach()
            error = "contract: " + "; ".join(event.violations)
            return fail(Failed(outcome, self.status, error, problem), self.mode)
        return _captured(self.outcome, self.status, self.mode, self.whole)


def _captured(outcome: Outcome, status: int, mode: Mode, whole: bool) -> AttemptState:
    """After the capture: the outcome is stored before the client sees a byte of a whole body,
    so that a client that retries after a lost response always finds it; a larger one streams
    through (SPEC §7), in a race only once it won the CAS."""
    if whole:
        if outcome is Outcome.COMPLETE:
            return Complete(Body.KEPT, after_head=False, then=Answer())
        return Settle(Failed(outcome, status, None), after_head=False, then=Answer())
    if completes_before_head(outcome, mode):
        return Complete(Body.OMITTED, after_head=False, then=StreamThrough(outcome, status, True))
    return StreamThrough(outcome, status, completed=False)


@frozen
class StreamThrough:
    """Command: pass the rest of a body too large to keep to the client (SPEC §7)."""

    outcome: Outcome
    status: int
    completed: bool  # in a race, it completed the job before its head went out

    def next(self, event: BodyEnded | BodyCut) -> AttemptState:
        if isinstance(event, BodyCut):
            if self.completed:
                return Abort()  # the job is completed; what broke off is the client's loss
            cut = Failed(classify_cut_off(), self.status, event.reason)
            return Settle(cut, after_head=True, then=Abort())
        if self.outcome is not Outcome.COMPLETE:
            return Settle(Failed(self.outcome, self.status, None), after_head=True, then=Finish())
        if self.completed:
            return Finish()
        return Complete(Body.OMITTED, after_head=True, then=Finish())


@frozen
class Stream:
    """Command: a stream of events to the client as it arrives, kept up to max_stored_body, and
    stored once it ended (SPEC §2 step 4)."""

    outcome: Outcome
    status: int

    def next(self, event: BodyEnded | BodyCut) -> AttemptState:
        if isinstance(event, BodyCut):
            cut = Failed(classify_cut_off(), self.status, event.reason)
            return Settle(cut, after_head=True, then=Abort())
        if self.outcome is Outcome.COMPLETE:
            return Complete(Body.KEPT, after_head=True, then=Finish())
        return Settle(Failed(self.outcome, self.status, None), after_head=True, then=Finish())


def cut_off(reason: str) -> Failed:
    """An attempt cut off by shutdown: its request may have reached the upstream (SPEC §3.2)."""
    return Failed(classify_cut_off(), None, reason)


AttemptState = (
    Forward
    | Capture
    | CheckContract
    | Stream
    | StreamThrough
    | Complete
    | Settle
    | Answer
    | Finish
    | Abort
    | AnswerProblem
    | HandBack
    | KeepReply
    | Lost
)
