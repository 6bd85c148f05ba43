"""The state table (core/states.py): every operation's row, and the functions the stores call."""

from __future__ import annotations

import pytest

from idemproxy.core.states import (
    ATTEMPT_END,
    ATTEMPT_STATE_OF,
    EXPIRABLE,
    JOB_STATE_OF,
    LEASED,
    RESOLVABLE,
    RUNNING,
    TRANSITIONS,
    AttemptChange,
    Lease,
    Operation,
    attempt_end,
    settle_states,
)
from idemproxy.core.types import AttemptState, JobState

IN_FLIGHT, COMPLETED, RELEASED, UNKNOWN = (
    JobState.IN_FLIGHT,
    JobState.COMPLETED,
    JobState.RELEASED,
    JobState.UNKNOWN,
)


def test_every_operation_has_a_row() -> None:
    assert set(TRANSITIONS) == set(Operation)


# (operation, accepted job states, state left, bumps the version, lease, new attempt, deletes)
ROWS = [
    (Operation.CLAIM, set(), IN_FLIGHT, False, Lease.RENEWED, True, False),
    (Operation.COMPLETE, {IN_FLIGHT}, COMPLETED, True, Lease.CLEARED, False, False),
    (Operation.SETTLE_RELEASED, {IN_FLIGHT}, RELEASED, True, Lease.CLEARED, False, False),
    (Operation.SETTLE_UNKNOWN, {IN_FLIGHT}, UNKNOWN, True, Lease.CLEARED, False, False),
    (Operation.FINISH_ATTEMPT_RELEASED, set(JobState), None, False, Lease.KEPT, False, False),
    (Operation.FINISH_ATTEMPT_UNKNOWN, set(JobState), None, False, Lease.KEPT, False, False),
    (Operation.START_NEXT_ATTEMPT, {RELEASED}, IN_FLIGHT, True, Lease.RENEWED, True, False),
    (Operation.FAIL_OVER, {IN_FLIGHT}, None, True, Lease.RENEWED, True, False),
    (Operation.ADD_ATTEMPT, {IN_FLIGHT}, None, False, Lease.RENEWED, True, False),
    (Operation.RENEW_LEASE, {IN_FLIGHT}, None, False, Lease.RENEWED, False, False),
    (Operation.TAKE_OVER, {IN_FLIGHT}, UNKNOWN, True, Lease.CLEARED, False, False),
    (Operation.RESOLVE_COMPLETED, {UNKNOWN}, COMPLETED, True, Lease.KEPT, False, False),
    (Operation.RESOLVE_RELEASED, {UNKNOWN}, RELEASED, True, Lease.KEPT, False, False),
    (Operation.FORGET, {COMPLETED, RELEASED}, None, False, Lease.KEPT, False, True),
    (Operation.SWEEP, {COMPLETED, RELEASED}, None, False, Lease.KEPT, False, True),
    (Operation.DELETE, set(JobState), None, False, Lease.KEPT, False, True),
]


@pytest.mark.parametrize(
    ("operation", "source", "target", "bumps", "lease", "new_attempt", "deletes"), ROWS
)
def test_the_row_of(
    operation: Operation,
    source: set[JobState],
    target: JobState | None,
    bumps: bool,
    lease: Lease,
    new_attempt: bool,
    deletes: bool,
) -> None:
    row = TRANSITIONS[operation]
    assert (row.source, row.target, row.bumps_version) == (frozenset(source), target, bumps)
    assert (row.lease, row.new_attempt, row.deletes) == (lease, new_attempt, deletes)


STARTED, FAILED = AttemptState.STARTED, AttemptState.FAILED


@pytest.mark.parametrize(
    ("operation", "changes"),
    [
        (
            Operation.COMPLETE,
            [
                ({STARTED, AttemptState.UNKNOWN}, AttemptState.SUCCEEDED),
                ({STARTED, AttemptState.UNKNOWN}, AttemptState.DISCARDED),
            ],
        ),
        (Operation.SETTLE_RELEASED, [({STARTED}, FAILED)]),
        (Operation.SETTLE_UNKNOWN, [({STARTED}, AttemptState.UNKNOWN)]),
        (Operation.FINISH_ATTEMPT_RELEASED, [({STARTED}, FAILED)]),
        (Operation.FINISH_ATTEMPT_UNKNOWN, [({STARTED}, AttemptState.UNKNOWN)]),
        (Operation.FAIL_OVER, [({STARTED}, FAILED)]),
        (Operation.TAKE_OVER, [({STARTED}, AttemptState.UNKNOWN)]),
    ],
)
def test_the_attempts_an_operation_moves(
    operation: Operation, changes: list[tuple[set[AttemptState], AttemptState]]
) -> None:
    expected = {AttemptChange(frozenset(source), target) for source, target in changes}
    assert TRANSITIONS[operation].attempts == expected


def test_the_other_operations_move_no_attempt() -> None:
    moving = {
        Operation.COMPLETE,
        Operation.SETTLE_RELEASED,
        Operation.SETTLE_UNKNOWN,
        Operation.FINISH_ATTEMPT_RELEASED,
        Operation.FINISH_ATTEMPT_UNKNOWN,
        Operation.FAIL_OVER,
        Operation.TAKE_OVER,
    }
    for operation in set(Operation) - moving:
        assert TRANSITIONS[operation].attempts == frozenset(), operation


def test_the_sets() -> None:
    assert {IN_FLIGHT} == LEASED
    assert {COMPLETED, RELEASED} == EXPIRABLE
    assert {UNKNOWN} == RESOLVABLE
    assert {STARTED} == RUNNING
    # SPEC §11: a job in flight or unknown is never swept.
    assert not EXPIRABLE & (LEASED | RESOLVABLE)


def test_only_a_job_in_flight_can_be_taken_over_completed_or_settled() -> None:
    for operation in (Operation.COMPLETE, Operation.SETTLE_RELEASED, Operation.TAKE_OVER):
        assert TRANSITIONS[operation].source == LEASED


@pytest.mark.parametrize(
    ("state", "expected"),
    [(RELEASED, (RELEASED, FAILED)), (UNKNOWN, (UNKNOWN, AttemptState.UNKNOWN))],
)
def test_settle_states(state: JobState, expected: tuple[JobState, AttemptState]) -> None:
    assert settle_states(state) == expected


@pytest.mark.parametrize("state", [IN_FLIGHT, COMPLETED])
def test_settle_refuses_other_states(state: JobState) -> None:
    with pytest.raises(ValueError, match="settle cannot"):
        settle_states(state)


def test_attempt_end() -> None:
    assert attempt_end(RELEASED) is FAILED
    assert attempt_end(UNKNOWN) is AttemptState.UNKNOWN
    assert dict(ATTEMPT_END) == {RELEASED: FAILED, UNKNOWN: AttemptState.UNKNOWN}
    with pytest.raises(ValueError, match="cannot leave"):
        attempt_end(COMPLETED)


def test_the_stored_text_of_every_state_decodes() -> None:
    assert {state: JOB_STATE_OF[state.value] for state in JobState} == {s: s for s in JobState}
    assert {s: ATTEMPT_STATE_OF[s.value] for s in AttemptState} == {s: s for s in AttemptState}
