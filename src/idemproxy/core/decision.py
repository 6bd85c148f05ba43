"""The idempotency decision: pure code over plain data, no I/O, no clock (SPEC §2, §3).

* `decide(job, ...)` says what to do with a request whose key already has a job;
* `classify_response(...)`, `classify_failure(...)` and `classify_breach()` say what an attempt's
  result means, `moves_on` whether another upstream may be tried and `race_outcome` what a race
  of hedged attempts ends in;
* `unsent_claim(...)` says what became of a claim this process gave up on.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from idemproxy.core.types import Job, JobState, StoredResponse
from idemproxy.errors import (
    ContractViolation,
    OutcomeUnknown,
    PayloadMismatch,
    ProblemError,
    RequestInFlight,
    UpstreamTimeout,
    UpstreamUnavailable,
)


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer with the stored response (SPEC §7)."""

    response: StoredResponse


@dataclass(frozen=True, slots=True)
class Reject:
    """Answer with a problem; nothing goes upstream."""

    problem: type[ProblemError]


@dataclass(frozen=True, slots=True)
class Hold:
    """Wait for the job to leave `in_flight`, then decide again (SPEC §2.3)."""


@dataclass(frozen=True, slots=True)
class StartNextAttempt:
    """The job was released: try to win the CAS on `version` and run a new attempt."""

    version: int


@dataclass(frozen=True, slots=True)
class TakeOver:
    """The proxy running the job died (SPEC §3.5): CAS it to `unknown` on `version`."""

    version: int


@dataclass(frozen=True, slots=True)
class Forget:
    """The job has expired (SPEC §11): delete it by CAS on `version` and claim afresh."""

    version: int


Decision = Replay | Reject | Hold | StartNextAttempt | TakeOver | Forget


@dataclass(frozen=True, slots=True)
class Policy:
    """`hold_in_flight` is False in the ietf profile: a duplicate in flight gets 409 at once."""

    hold_in_flight: bool = True


def decide(job: Job, fingerprint: str, policy: Policy, *, wait_expired: bool = False) -> Decision:
    """What to do with a request for an existing job (SPEC §2.3)."""
    if job.expired and job.state in (JobState.COMPLETED, JobState.RELEASED):
        # SPEC §3.1: an expired job is gone, whatever its sweeper has not deleted yet.
        return Forget(job.version)
    if job.fingerprint != fingerprint:
        return Reject(PayloadMismatch)
    if job.state is JobState.COMPLETED:
        assert job.response is not None, "a completed job always has a response"
        return Replay(job.response)
    if job.state is JobState.RELEASED:
        return StartNextAttempt(job.version)
    if job.state is JobState.UNKNOWN:
        return Reject(OutcomeUnknown)
    if job.lease_expired:
        # Nobody renews the lease: the attempt may or may not have reached the upstream.
        return TakeOver(job.version)
    if policy.hold_in_flight and not wait_expired:
        return Hold()
    return Reject(RequestInFlight)


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
    if failure is Failure.CONNECT:
        return Outcome.RELEASE, UpstreamUnavailable
    if failure is Failure.TIMEOUT:
        return Outcome.UNKNOWN, UpstreamTimeout
    return Outcome.UNKNOWN, UpstreamUnavailable


def classify_breach() -> tuple[Outcome, type[ProblemError]]:
    """A 2xx that breaks the route's response contract, or is too large to check against it
    (SPEC §3.4): a 2xx proves the upstream acted, so the job is unknown, never released or
    failed over (running it again would execute it twice) and never completed with a response
    the contract refuses."""
    return Outcome.UNKNOWN, ContractViolation


def moves_on(outcome: Outcome) -> bool:
    """Whether another attempt may start after this one (SPEC §3.4): only after an outcome that
    proves nothing executed, a release."""
    return outcome is Outcome.RELEASE


def race_outcome(outcomes: Iterable[Outcome]) -> Outcome:
    """The job's outcome when every attempt of a race failed (SPEC §3.4): unknown if any of
    them may have executed, else released."""
    return Outcome.RELEASE if all(moves_on(o) for o in outcomes) else Outcome.UNKNOWN


class Unsent(enum.Enum):
    """What a job read afterwards says about a claim this process gave up on
    (proxy/background/unsent.py)."""

    RELEASE = "release"  # the claim committed after all, and nothing else happened to it since
    NOT_YET = "not_yet"  # no job under the key: the claim may still commit, or never will
    MOVED_ON = "moved_on"  # another job holds the key, or this one moved on: leave it alone


def unsent_claim(job: Job | None, job_id: str) -> Unsent:
    """SPEC §3.1: `in_flight` → `released` when nothing executed. A claim that timed out at the
    proxy was never forwarded, but the store may commit it later, leaving a job nobody runs.
    Only that job, untouched (its first version, in flight, with its one attempt), may be
    released by the process that claimed it; once taken over it is `unknown`, and only a
    resolution may end that (§3.3)."""
    if job is None:
        return Unsent.NOT_YET
    untouched = job.state is JobState.IN_FLIGHT and job.version == 1 and job.attempt_count == 1
    return Unsent.RELEASE if job.id == job_id and untouched else Unsent.MOVED_ON
