"""The job and attempt state machine as data (SPEC §3): for every store operation, the job states
its compare-and-swap accepts, the state it leaves the job in, whether it bumps the version, what
it does to the lease, and what it does to the attempts. Pure data and functions, no I/O.

The stores follow this table: their code takes its states from here, and their SQL writes the
same states as literals (a partial index, such as the one over jobs in flight, only serves a
statement whose state is a literal). tests/store/test_state_table.py reads every statement of
both dialects and fails when one disagrees with this table.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from idemproxy.core.types import AttemptState, JobState

ALL_JOB_STATES = frozenset(JobState)
ALL_ATTEMPT_STATES = frozenset(AttemptState)

# SPEC §3.5: only a job in flight has a lease. Its expiry (by the database clock) makes the job
# `lease_expired`, lets a takeover mark it `unknown`, and lets an operator delete it unforced.
LEASED = frozenset({JobState.IN_FLIGHT})
# SPEC §11: the terminal states whose jobs are deleted once they expire, freeing their keys; a job
# in flight or unknown is never swept (the first still runs, the second awaits an operator).
EXPIRABLE = frozenset({JobState.COMPLETED, JobState.RELEASED})
# SPEC §3.3: the state an operator (or unknown_ttl) resolves.
RESOLVABLE = frozenset({JobState.UNKNOWN})
# SPEC §3.3: a response that lost the completion because its job was taken over (and so is
# `unknown`) is kept on its attempt for the operator; a hedging loser's is not.
LATE_RESPONSE_KEPT = frozenset({JobState.UNKNOWN})

# SPEC §3.2: what a failed attempt is marked when its failure leaves the job `released` (nothing
# executed) or `unknown` (it may have executed).
ATTEMPT_END: Mapping[JobState, AttemptState] = MappingProxyType(
    {JobState.RELEASED: AttemptState.FAILED, JobState.UNKNOWN: AttemptState.UNKNOWN}
)

# Stored state text to the enumeration: `JobState(value)` goes through EnumMeta.__call__ (about a
# microsecond), a dict lookup does not, and every job a store returns is decoded.
JOB_STATE_OF: Mapping[str, JobState] = MappingProxyType({s.value: s for s in JobState})
ATTEMPT_STATE_OF: Mapping[str, AttemptState] = MappingProxyType({s.value: s for s in AttemptState})


class Lease(enum.Enum):
    """What an operation does to the lease of the job and its attempts (SPEC §3.5)."""

    KEPT = "kept"  # left as it is
    RENEWED = "renewed"  # now + lease, by the database clock
    CLEARED = "cleared"  # none: the job left in_flight


class Operation(enum.StrEnum):
    """The store operations that change a job (store/base.py `Store`)."""

    CLAIM = "claim"
    COMPLETE = "complete"
    SETTLE_RELEASED = "settle_released"
    SETTLE_UNKNOWN = "settle_unknown"
    FINISH_ATTEMPT_RELEASED = "finish_attempt_released"
    FINISH_ATTEMPT_UNKNOWN = "finish_attempt_unknown"
    START_NEXT_ATTEMPT = "start_next_attempt"
    FAIL_OVER = "fail_over"
    ADD_ATTEMPT = "add_attempt"
    RENEW_LEASE = "renew_lease"
    TAKE_OVER = "take_over"
    RESEND = "resend"
    RESOLVE_COMPLETED = "resolve_completed"
    RESOLVE_RELEASED = "resolve_released"
    FORGET = "forget"
    SWEEP = "sweep"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class AttemptChange:
    """Attempts of the job in one of `source` states are moved to `target`."""

    source: frozenset[AttemptState]
    target: AttemptState


@dataclass(frozen=True, slots=True)
class Transition:
    """What one operation does (SPEC §3).

    `source`: the job states its compare-and-swap accepts (empty: the job is created). `target`:
    the state it leaves the job in; None when the job keeps its state or is deleted. `deletes`:
    the job and its attempts are gone. `attempts`: the attempt rows it changes; `new_attempt`:
    it starts one more attempt (`started`).
    """

    source: frozenset[JobState]
    target: JobState | None
    bumps_version: bool
    lease: Lease
    attempts: frozenset[AttemptChange] = frozenset()
    new_attempt: bool = False
    deletes: bool = False


# SPEC §3.5: the attempts that are running; they share their job's lease.
RUNNING = frozenset({AttemptState.STARTED})
# A completion may come from an attempt a takeover already marked `unknown` (SPEC §3.3).
_REPORTING = frozenset({AttemptState.STARTED, AttemptState.UNKNOWN})


def _settled(target: JobState) -> Transition:
    return Transition(
        source=LEASED,
        target=target,
        bumps_version=True,
        lease=Lease.CLEARED,
        attempts=frozenset({AttemptChange(RUNNING, ATTEMPT_END[target])}),
    )


def _attempt_finished(end: JobState) -> Transition:
    # Hedging (SPEC §3.4): one attempt of several ends; the job is left to the others.
    return Transition(
        source=ALL_JOB_STATES,
        target=None,
        bumps_version=False,
        lease=Lease.KEPT,
        attempts=frozenset({AttemptChange(RUNNING, ATTEMPT_END[end])}),
    )


TRANSITIONS: Mapping[Operation, Transition] = MappingProxyType(
    {
        # SPEC §2.2: the job and its first attempt, in one step.
        Operation.CLAIM: Transition(
            source=frozenset(),
            target=JobState.IN_FLIGHT,
            bumps_version=False,
            lease=Lease.RENEWED,
            new_attempt=True,
        ),
        # SPEC §3.1: exactly one attempt's result wins; a late one is discarded.
        Operation.COMPLETE: Transition(
            source=LEASED,
            target=JobState.COMPLETED,
            bumps_version=True,
            lease=Lease.CLEARED,
            attempts=frozenset(
                {
                    AttemptChange(_REPORTING, AttemptState.SUCCEEDED),
                    AttemptChange(_REPORTING, AttemptState.DISCARDED),
                }
            ),
        ),
        Operation.SETTLE_RELEASED: _settled(JobState.RELEASED),
        Operation.SETTLE_UNKNOWN: _settled(JobState.UNKNOWN),
        Operation.FINISH_ATTEMPT_RELEASED: _attempt_finished(JobState.RELEASED),
        Operation.FINISH_ATTEMPT_UNKNOWN: _attempt_finished(JobState.UNKNOWN),
        # SPEC §2.3: one retry of a released job runs the next attempt.
        Operation.START_NEXT_ATTEMPT: Transition(
            source=frozenset({JobState.RELEASED}),
            target=JobState.IN_FLIGHT,
            bumps_version=True,
            lease=Lease.RENEWED,
            new_attempt=True,
        ),
        # SPEC §3.4: nothing executed; the next upstream, the job staying in flight.
        Operation.FAIL_OVER: Transition(
            source=LEASED,
            target=None,
            bumps_version=True,
            lease=Lease.RENEWED,
            attempts=frozenset({AttemptChange(RUNNING, ATTEMPT_END[JobState.RELEASED])}),
            new_attempt=True,
        ),
        # SPEC §3.4: a hedge races the attempts already running for the same completion CAS,
        # so the version stays.
        Operation.ADD_ATTEMPT: Transition(
            source=LEASED,
            target=None,
            bumps_version=False,
            lease=Lease.RENEWED,
            new_attempt=True,
        ),
        Operation.RENEW_LEASE: Transition(
            source=LEASED, target=None, bumps_version=False, lease=Lease.RENEWED
        ),
        # SPEC §3.5: the lease ran out; whatever ran may have executed.
        Operation.TAKE_OVER: Transition(
            source=LEASED,
            target=JobState.UNKNOWN,
            bumps_version=True,
            lease=Lease.CLEARED,
            attempts=frozenset({AttemptChange(RUNNING, AttemptState.UNKNOWN)}),
        ),
        # SPEC §3.6: an `unknown` job sent again under the key its upstream honours, as a new
        # attempt; exactly one retry wins.
        Operation.RESEND: Transition(
            source=RESOLVABLE,
            target=JobState.IN_FLIGHT,
            bumps_version=True,
            lease=Lease.RENEWED,
            new_attempt=True,
        ),
        Operation.RESOLVE_COMPLETED: Transition(
            source=RESOLVABLE, target=JobState.COMPLETED, bumps_version=True, lease=Lease.KEPT
        ),
        Operation.RESOLVE_RELEASED: Transition(
            source=RESOLVABLE, target=JobState.RELEASED, bumps_version=True, lease=Lease.KEPT
        ),
        Operation.FORGET: Transition(
            source=EXPIRABLE, target=None, bumps_version=False, lease=Lease.KEPT, deletes=True
        ),
        Operation.SWEEP: Transition(
            source=EXPIRABLE, target=None, bumps_version=False, lease=Lease.KEPT, deletes=True
        ),
        # SPEC §3.3: any state; a job in LEASED states under a live lease only when forced.
        Operation.DELETE: Transition(
            source=ALL_JOB_STATES, target=None, bumps_version=False, lease=Lease.KEPT, deletes=True
        ),
    }
)


def settle_states(state: JobState) -> tuple[JobState, AttemptState]:
    """The (job state, attempt state) `Store.settle` writes for a failed attempt (SPEC §3.2)."""
    operation = _SETTLE.get(state)
    if operation is None:
        raise ValueError(f"settle cannot move a job to {state}")
    transition = TRANSITIONS[operation]
    assert transition.target is not None
    (change,) = transition.attempts
    return transition.target, change.target


def attempt_end(state: JobState) -> AttemptState:
    """The state `Store.finish_attempt` gives one failed attempt of several (SPEC §3.4)."""
    operation = _FINISH_ATTEMPT.get(state)
    if operation is None:
        raise ValueError(f"an attempt's failure cannot leave its job {state}")
    (change,) = TRANSITIONS[operation].attempts
    return change.target


_SETTLE = {JobState.RELEASED: Operation.SETTLE_RELEASED, JobState.UNKNOWN: Operation.SETTLE_UNKNOWN}
_FINISH_ATTEMPT = {
    JobState.RELEASED: Operation.FINISH_ATTEMPT_RELEASED,
    JobState.UNKNOWN: Operation.FINISH_ATTEMPT_UNKNOWN,
}
