"""What to do with a job: pure code over plain data, no I/O, no clock (SPEC §2, §3).

* `decide(job, ...)` says what to do with a request whose key already has a job;
* `unsent_claim(...)` says what became of a claim this process gave up on.

What an attempt's result means is core/machine.py's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import assert_never

from idemproxy.core.states import EXPIRABLE
from idemproxy.core.types import Job, JobState, KeptResponse
from idemproxy.errors import OutcomeUnknown, PayloadMismatch, ProblemError, RequestInFlight


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer with the stored response (SPEC §7), opened first when it is sealed (§11): the
    fingerprint was compared before, so a payload mismatch never costs a decryption."""

    response: KeptResponse


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


@dataclass(frozen=True, slots=True)
class AskAbout:
    """SPEC §3.6: the job is `unknown` on a route that can ask whether it executed: ask (if a
    question is due), then decide again on what the job is then."""

    version: int


Decision = Replay | Reject | Hold | StartNextAttempt | TakeOver | Forget | AskAbout


@dataclass(frozen=True, slots=True)
class Policy:
    """`hold_in_flight` is False in the ietf profile: a duplicate in flight gets 409 at once."""

    hold_in_flight: bool = True


def decide(
    job: Job,
    fingerprint: str,
    policy: Policy,
    *,
    wait_expired: bool = False,
    ask: bool = False,
    earlier: str | None = None,
) -> Decision:
    """What to do with a request for an existing job (SPEC §2.3). `ask`: an `unknown` job may
    be asked about once more for this request (SPEC §3.6). `earlier`: the fingerprint the
    request had before `fingerprint_headers` was set, which a job stored then matches (SPEC §6):
    no job stored since has it, as every fingerprint then has the headers' field."""
    if job.expired and job.state in EXPIRABLE:
        # SPEC §3.1: an expired job is gone, whatever its sweeper has not deleted yet.
        return Forget(job.version)
    if job.fingerprint != fingerprint and (earlier is None or job.fingerprint != earlier):
        return Reject(PayloadMismatch)
    match job.state:
        case JobState.COMPLETED:
            assert job.response is not None, "a completed job always has a response"
            return Replay(job.response)
        case JobState.RELEASED:
            return StartNextAttempt(job.version)
        case JobState.UNKNOWN:
            return AskAbout(job.version) if ask else Reject(OutcomeUnknown)
        case JobState.IN_FLIGHT:
            return _in_flight(job, policy, wait_expired=wait_expired)
        case _:
            assert_never(job.state)


def _in_flight(job: Job, policy: Policy, *, wait_expired: bool) -> Decision:
    if job.lease_expired:
        # Nobody renews the lease: the attempt may or may not have reached the upstream.
        return TakeOver(job.version)
    if policy.hold_in_flight and not wait_expired:
        return Hold()
    return Reject(RequestInFlight)


class Unsent(enum.Enum):
    """What a job read afterwards says about a claim this process gave up on
    (proxy/background/unsent.py)."""

    RELEASE = "release"  # the claim committed after all, and nothing else happened to it since
    NOT_YET = "not_yet"  # no job under the key: the claim may still commit, or never will
    MOVED_ON = "moved_on"  # another job holds the key, or this one moved on: leave it alone


def unsent_claim(
    job: Job | None, job_id: str, *, version: int = 1, attempt: int = 1, token: str | None = None
) -> Unsent:
    """SPEC §3.1: `in_flight` → `released` when nothing executed. A statement that starts an
    attempt failed at the proxy, so that attempt was never forwarded, but the store may commit
    it later, leaving a job nobody runs: the claim (a job of its own id), or `start_next_attempt`
    and `fail_over` (§3.4: `version` and `attempt`, the job's version and attempt count once it
    committed, and `token`, its `started_by`: another retry may have started the same attempt
    number). Only that job, untouched since, may be released by the process that started it;
    once taken over it is `unknown`, and only a resolution may end that (§3.3). A job still at
    an older version may yet see the statement commit."""
    if job is None:
        return Unsent.NOT_YET
    if job.id != job_id:
        return Unsent.MOVED_ON
    if job.version < version and job.attempt_count < attempt:
        return Unsent.NOT_YET
    untouched = (
        job.state is JobState.IN_FLIGHT
        and job.version == version
        and job.attempt_count == attempt
        and job.started_by == token
    )
    return Unsent.RELEASE if untouched else Unsent.MOVED_ON
