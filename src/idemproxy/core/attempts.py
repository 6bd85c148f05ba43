"""What an attempt's result means: pure code over plain data, no I/O, no clock (SPEC §3.2, §3.4).

* `classify_response`, `classify_failure`, `classify_breach` and `classify_cut_off` give the
  outcome of an attempt (complete, release, unknown) for what its upstream did;
* `handed_back` and `response_handling` say, by the attempt's `Mode`, whether its caller decides
  what a failed outcome does to the job, and how the response is carried on;
* `settled_state` is the job state a failed outcome settles the job in;
* `moves_on`, `none_executed`, `may_hedge` and `brings_in_next` say when another upstream may
  come in (fail-over and hedging); `race_outcome`, `race_end` and `settling_index` what a race
  of hedged attempts ends in, and which failure settles its job.

The I/O around them is in proxy/jobs/attempt.py (one attempt) and proxy/jobs/jobrun.py (the
attempts of one job).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import assert_never

from idemproxy.core.types import JobState
from idemproxy.errors import ContractViolation, ProblemError, UpstreamTimeout, UpstreamUnavailable


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


class RaceEnd(enum.Enum):
    """How a race of hedged attempts ended when none of them answered this client (SPEC §3.4)."""

    LOST = "lost"  # an attempt lost the completion CAS: another one completed the job
    STORE_ERROR = "store-error"  # a racer's outcome was not written: the race cannot settle
    ALL_FAILED = "all-failed"  # every racer failed: the race settles the job


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


def race_outcome(outcomes: Iterable[Outcome]) -> Outcome:
    """The job's outcome when every attempt of a race failed (SPEC §3.4): unknown if any of
    them may have executed, else released."""
    return Outcome.RELEASE if all(moves_on(o) for o in outcomes) else Outcome.UNKNOWN


def none_executed(failures: Iterable[Outcome], *, store_errors: bool) -> bool:
    """SPEC §3.4: whether no racer so far may have executed. A racer that ended with a store
    error (its outcome not written, or its answer not stored) is one whose outcome the race does
    not know: it may have executed."""
    return not store_errors and race_outcome(failures) is Outcome.RELEASE


def may_hedge(*, started: int, upstreams: int, lost: bool, none_executed: bool) -> bool:
    """Whether the race may still bring in another upstream (SPEC §3.4): one is left, no racer
    lost the completion CAS (another attempt completed the job), and none may have executed."""
    return started < upstreams and not lost and none_executed


def brings_in_next(*, admitted: bool, none_executed: bool, timed_out: bool, racing: bool) -> bool:
    """After one wait of the race: whether the next upstream comes in now. It must have been
    admitted before the wait (`may_hedge`) and still be (no racer that ended meanwhile may have
    executed), and either no answer came within hedge_after (`timed_out`) or every racer failed
    (none is `racing` any more)."""
    return admitted and none_executed and (timed_out or not racing)


def race_end(*, lost: bool, store_errors: bool) -> RaceEnd:
    """What a race without a winner for this client ends in: another attempt's completion
    first (its response is the job's), then a store error (SPEC §11: 503), else every racer
    failed."""
    if lost:
        return RaceEnd.LOST
    if store_errors:
        return RaceEnd.STORE_ERROR
    return RaceEnd.ALL_FAILED


def settling_index(outcomes: Sequence[Outcome]) -> int:
    """Which of a race's failures, in the order they ended, settles the job and answers the
    client (SPEC §3.4): the last unknown one if any racer may have executed, else the last."""
    if not outcomes:
        raise ValueError("a race that ended without a winner had failures")
    for index in range(len(outcomes) - 1, -1, -1):
        if outcomes[index] is Outcome.UNKNOWN:
            return index
    return len(outcomes) - 1
