"""SPEC §2.4, §3.2, §3.4, §7: an attempt's life, and its job's attempts, as tables of
state x event -> next state (core/machine.py, core/attempt_order.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from idemproxy.constants import DEFAULT_RELEASE_STATUSES, DEFAULT_UNKNOWN_STATUSES
from idemproxy.core.attempt_order import (
    AddHedge,
    FailOver,
    Race,
    RaceLost,
    RacerEnd,
    RaceStoreError,
    SettleRace,
    Try,
    Wait,
    racer_end,
)
from idemproxy.core.machine import (
    Abort,
    Answer,
    AnswerProblem,
    AttemptState,
    Body,
    BodyCaptured,
    BodyCut,
    BodyEnded,
    Capture,
    CheckContract,
    Checked,
    Complete,
    Failed,
    Failure,
    Finish,
    Forward,
    HandBack,
    Head,
    KeepReply,
    Lost,
    Mode,
    Outcome,
    Settle,
    StatusPolicy,
    Stream,
    StreamThrough,
    TransportFailed,
    cut_off,
)
from idemproxy.errors import ContractViolation, UpstreamTimeout, UpstreamUnavailable

STATUSES = StatusPolicy(DEFAULT_RELEASE_STATUSES, DEFAULT_UNKNOWN_STATUSES)
FINAL, FAIL_OVER, HEDGED = Mode.FINAL, Mode.FAIL_OVER, Mode.HEDGED
COMPLETE, RELEASE, UNKNOWN = Outcome.COMPLETE, Outcome.RELEASE, Outcome.UNKNOWN


def forward(mode: Mode, *, gated: bool = False) -> Forward:
    return Forward(mode, gated, STATUSES)


def settled(failed: Failed, then: AttemptState, *, after_head: bool = False) -> Settle:
    return Settle(failed, after_head=after_head, then=then)


def late(failed: Failed, then: AttemptState) -> Settle:
    """Settle the job once the response's head went out (SPEC §7)."""
    return settled(failed, then, after_head=True)


def problem(failed: Failed) -> Settle:
    """Settle the job, then answer the failure's problem (SPEC §3.2)."""
    return settled(failed, AnswerProblem(failed))


# --- Forward: each Handling, each outcome in each Mode ------------------------------------------

HEAD_ROWS = [
    # mode, gated, status, event stream -> next
    (FINAL, False, 200, False, Capture(COMPLETE, 200, FINAL, check=False)),
    (FINAL, True, 200, False, Capture(COMPLETE, 200, FINAL, check=True)),
    (FINAL, True, 503, False, Capture(RELEASE, 503, FINAL, check=False)),  # not stored: unchecked
    (FINAL, False, 503, False, Capture(RELEASE, 503, FINAL, check=False)),  # the last: settles
    (FINAL, False, 502, False, Capture(UNKNOWN, 502, FINAL, check=False)),
    (FINAL, False, 200, True, Stream(COMPLETE, 200)),
    (FINAL, False, 502, True, Stream(UNKNOWN, 502)),
    (FINAL, True, 200, True, Capture(COMPLETE, 200, FINAL, check=True)),  # a gate needs it whole
    (FAIL_OVER, False, 200, False, Capture(COMPLETE, 200, FAIL_OVER, check=False)),
    (FAIL_OVER, False, 200, True, Stream(COMPLETE, 200)),
    (FAIL_OVER, False, 503, False, HandBack(Failed(RELEASE, 503, None))),
    (FAIL_OVER, False, 503, True, HandBack(Failed(RELEASE, 503, None))),
    (FAIL_OVER, False, 504, False, Capture(UNKNOWN, 504, FAIL_OVER, check=False)),  # never over
    (HEDGED, False, 200, False, Capture(COMPLETE, 200, HEDGED, check=False)),
    (HEDGED, False, 200, True, Capture(COMPLETE, 200, HEDGED, check=False)),  # winner first
    (HEDGED, True, 201, False, Capture(COMPLETE, 201, HEDGED, check=True)),
    (HEDGED, False, 503, False, KeepReply(Failed(RELEASE, 503, None))),
    (HEDGED, False, 502, True, KeepReply(Failed(UNKNOWN, 502, None))),
]


@pytest.mark.parametrize(("mode", "gated", "status", "stream", "expected"), HEAD_ROWS)
def test_a_head(mode: Mode, gated: bool, status: int, stream: bool, expected: object) -> None:
    assert forward(mode, gated=gated).next(Head(status, stream)) == expected


CONNECT = Failed(RELEASE, None, "refused", UpstreamUnavailable)
TIMEOUT = Failed(UNKNOWN, None, "refused", UpstreamTimeout)
BROKEN = Failed(UNKNOWN, None, "refused", UpstreamUnavailable)
TRANSPORT_ROWS = [
    (FINAL, Failure.CONNECT, problem(CONNECT)),
    (FINAL, Failure.TIMEOUT, problem(TIMEOUT)),
    (FINAL, Failure.BROKEN, problem(BROKEN)),
    (FAIL_OVER, Failure.CONNECT, HandBack(CONNECT)),  # nothing executed: the next upstream
    (FAIL_OVER, Failure.TIMEOUT, problem(TIMEOUT)),  # may have executed: never failed over
    (FAIL_OVER, Failure.BROKEN, problem(BROKEN)),
    (HEDGED, Failure.CONNECT, HandBack(CONNECT)),  # in a race every failure waits for the others
    (HEDGED, Failure.TIMEOUT, HandBack(TIMEOUT)),
    (HEDGED, Failure.BROKEN, HandBack(BROKEN)),
]


@pytest.mark.parametrize(("mode", "failure", "expected"), TRANSPORT_ROWS)
def test_a_transport_failure(mode: Mode, failure: Failure, expected: object) -> None:
    assert forward(mode).next(TransportFailed(failure, "refused")) == expected


# --- SPEC §3.6: the request sent again under the key its upstream honours ------------------------

RESEND = Forward(FINAL, False, STATUSES, resend=True)
RESEND_HEAD_ROWS = [
    # status, event stream -> next: a final answer completes; anything else proves nothing
    (200, False, Capture(COMPLETE, 200, FINAL, check=False)),
    (201, True, Stream(COMPLETE, 201)),
    (400, False, Capture(COMPLETE, 400, FINAL, check=False)),  # final: the key's answer
    (408, False, Capture(UNKNOWN, 408, FINAL, check=False)),
    (409, False, Capture(UNKNOWN, 409, FINAL, check=False)),  # the first is still in progress
    (425, False, Capture(UNKNOWN, 425, FINAL, check=False)),
    (429, False, Capture(UNKNOWN, 429, FINAL, check=False)),
    (500, False, Capture(UNKNOWN, 500, FINAL, check=False)),
    (503, False, Capture(UNKNOWN, 503, FINAL, check=False)),  # never released: not RELEASE
    (503, True, Stream(UNKNOWN, 503)),
]


@pytest.mark.parametrize(("status", "stream", "expected"), RESEND_HEAD_ROWS)
def test_a_resends_head(status: int, stream: bool, expected: object) -> None:
    assert RESEND.next(Head(status, stream)) == expected


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        # a refused connection proves nothing of the earlier attempt: unknown, never released
        (Failure.CONNECT, problem(Failed(UNKNOWN, None, "refused", UpstreamUnavailable))),
        (Failure.TIMEOUT, problem(TIMEOUT)),
        (Failure.BROKEN, problem(BROKEN)),
    ],
)
def test_a_resends_transport_failure(failure: Failure, expected: object) -> None:
    assert RESEND.next(TransportFailed(failure, "refused")) == expected


# --- Capture and the contract gate --------------------------------------------------------------

CAPTURE_ROWS = [
    (Capture(COMPLETE, 200, FINAL, True), True, CheckContract(COMPLETE, 200, FINAL, whole=True)),
    (Capture(COMPLETE, 200, FINAL, True), False, CheckContract(COMPLETE, 200, FINAL, whole=False)),
    # The outcome is stored before the client sees a byte of a whole body.
    (Capture(COMPLETE, 200, FINAL, False), True, Complete(Body.KEPT, False, Answer())),
    (Capture(COMPLETE, 200, HEDGED, False), True, Complete(Body.KEPT, False, Answer())),
    (Capture(RELEASE, 503, FINAL, False), True, settled(Failed(RELEASE, 503, None), Answer())),
    (Capture(UNKNOWN, 502, FAIL_OVER, False), True, settled(Failed(UNKNOWN, 502, None), Answer())),
    # Too large to keep: streamed through; in a race, only once it won the CAS (SPEC §7).
    (Capture(COMPLETE, 200, FINAL, False), False, StreamThrough(COMPLETE, 200, completed=False)),
    (Capture(UNKNOWN, 502, FINAL, False), False, StreamThrough(UNKNOWN, 502, completed=False)),
    (
        Capture(COMPLETE, 200, HEDGED, False),
        False,
        Complete(Body.OMITTED, False, StreamThrough(COMPLETE, 200, completed=True)),
    ),
]


@pytest.mark.parametrize(("state", "whole", "expected"), CAPTURE_ROWS)
def test_a_capture(state: Capture, whole: bool, expected: object) -> None:
    assert state.next(BodyCaptured(whole)) == expected


BREACH = Failed(UNKNOWN, 200, "contract: a; b", ContractViolation)
CONTRACT_ROWS = [
    # SPEC §3.4: a breach is unknown, never released or failed over; in a race it is handed back.
    (CheckContract(COMPLETE, 200, FINAL, True), ("a", "b"), problem(BREACH)),
    (CheckContract(COMPLETE, 200, FAIL_OVER, True), ("a", "b"), problem(BREACH)),
    (CheckContract(COMPLETE, 200, HEDGED, False), ("a", "b"), HandBack(BREACH)),
    (CheckContract(COMPLETE, 200, FINAL, True), (), Complete(Body.KEPT, False, Answer())),
    (CheckContract(COMPLETE, 200, FINAL, False), (), StreamThrough(COMPLETE, 200, False)),
    (
        CheckContract(COMPLETE, 200, HEDGED, False),
        (),
        Complete(Body.OMITTED, False, StreamThrough(COMPLETE, 200, True)),
    ),
]


@pytest.mark.parametrize(("state", "violations", "expected"), CONTRACT_ROWS)
def test_a_contract_check(
    state: CheckContract, violations: tuple[str, ...], expected: object
) -> None:
    assert state.next(Checked(violations)) == expected


# --- the store's steps --------------------------------------------------------------------------

COMPLETE_ROWS = [
    (Complete(Body.KEPT, False, Answer()), True, Answer()),
    (Complete(Body.KEPT, False, Answer()), False, Lost()),  # another attempt won: discarded
    (Complete(Body.OMITTED, False, StreamThrough(COMPLETE, 200, True)), False, Lost()),
    # After the head, the response is on its way whatever the store says (SPEC §7).
    (Complete(Body.KEPT, True, Finish()), True, Finish()),
    (Complete(Body.KEPT, True, Finish()), False, Finish()),
    (Complete(Body.OMITTED, True, Finish()), None, Finish()),
]


@pytest.mark.parametrize(("state", "won", "expected"), COMPLETE_ROWS)
def test_a_completion(state: Complete, won: bool | None, expected: object) -> None:
    assert state.next(won) == expected


@pytest.mark.parametrize("then", [Answer(), Finish(), Abort(), AnswerProblem(BREACH)])
def test_a_settlement_goes_on_to_what_follows_it(then: AttemptState) -> None:
    assert settled(BREACH, then).next() == then


# --- streams and bodies streamed through, cut off or whole --------------------------------------

CUT = Failed(UNKNOWN, 200, "reset")
BODY_ROWS: list[tuple[Stream | StreamThrough, BodyEnded | BodyCut, AttemptState]] = [
    (Stream(COMPLETE, 200), BodyEnded(), Complete(Body.KEPT, True, Finish())),
    (Stream(UNKNOWN, 502), BodyEnded(), late(Failed(UNKNOWN, 502, None), Finish())),
    (Stream(COMPLETE, 200), BodyCut("reset"), late(CUT, Abort())),
    (Stream(RELEASE, 503), BodyCut("reset"), late(Failed(UNKNOWN, 503, "reset"), Abort())),
    (StreamThrough(COMPLETE, 200, False), BodyEnded(), Complete(Body.OMITTED, True, Finish())),
    (StreamThrough(COMPLETE, 200, True), BodyEnded(), Finish()),  # completed before its head
    (StreamThrough(UNKNOWN, 502, False), BodyEnded(), late(Failed(UNKNOWN, 502, None), Finish())),
    (StreamThrough(COMPLETE, 200, False), BodyCut("reset"), late(CUT, Abort())),
    (StreamThrough(COMPLETE, 200, True), BodyCut("reset"), Abort()),  # the job stays completed
]  # fmt: skip


@pytest.mark.parametrize(("state", "event", "expected"), BODY_ROWS)
def test_a_body_to_the_client(
    state: Stream | StreamThrough, event: BodyEnded | BodyCut, expected: object
) -> None:
    assert state.next(event) == expected


def test_a_cut_off_by_shutdown_is_unknown() -> None:
    assert cut_off("cut off by shutdown") == Failed(UNKNOWN, None, "cut off by shutdown")


# --- SPEC §7: one response per request, over every path -----------------------------------------

_AFTER_HEAD_ENDS = (Finish, Abort)


def _successors(state: AttemptState) -> Iterator[AttemptState]:
    """Every state one event away from `state`."""
    match state:
        case Forward():
            for status in (200, 502, 503):
                for stream in (False, True):
                    yield state.next(Head(status, stream))
            for failure in Failure:
                yield state.next(TransportFailed(failure, "x"))
        case Capture():
            yield from (state.next(BodyCaptured(whole)) for whole in (False, True))
        case CheckContract():
            yield from (state.next(Checked(found)) for found in ((), ("x",)))
        case Complete():
            yield from (state.next(won) for won in (True, False, None))
        case Settle():
            yield state.next()
        case Stream() | StreamThrough():
            yield from (state.next(event) for event in (BodyEnded(), BodyCut("x")))


def _paths(state: AttemptState, head_out: bool = False) -> Iterator[tuple[AttemptState, bool]]:
    for following in _successors(state):
        out = head_out or isinstance(following, Stream | StreamThrough)
        yield following, out
        yield from _paths(following, out)


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("gated", [False, True])
def test_once_the_head_went_out_every_path_ends_the_same_response(mode: Mode, gated: bool) -> None:
    """A state after the head reached the client stores only as `after_head` (a store error is
    then no second answer) and ends streaming (finish or abort); before it, a store step may
    raise, and nothing streams."""
    ends = set()
    for state, head_out in _paths(forward(mode, gated=gated)):
        if head_out and isinstance(state, Complete | Settle):
            assert state.after_head, state
        if head_out and not isinstance(state, Stream | StreamThrough | Complete | Settle):
            assert isinstance(state, _AFTER_HEAD_ENDS), state
        if not head_out and isinstance(state, Complete | Settle):
            assert not state.after_head, state
        if not isinstance(state, Forward | Capture | CheckContract | Complete | Settle):
            ends.add(type(state))
    if mode is HEDGED:  # in a race nothing streams before the CAS is won, and failures wait
        assert Stream not in ends
        assert HandBack in ends and KeepReply in ends and AnswerProblem not in ends
    else:
        assert KeepReply not in ends and AnswerProblem in ends


# --- in order: the fail-over chain --------------------------------------------------------------


def test_a_fail_over_chain_runs_to_the_last_upstream_which_never_hands_back() -> None:
    state = Try(0, 3)
    modes = [state.mode]
    for index in (1, 2):
        fail_over = state.next()
        assert fail_over == FailOver(index, 3)
        following = fail_over.next(True)
        assert isinstance(following, Try)
        assert following == Try(index, 3)
        state = following
        modes.append(state.mode)
    assert modes == [FAIL_OVER, FAIL_OVER, FINAL]
    with pytest.raises(ValueError, match="FINAL"):
        state.next()


def test_a_fail_over_the_job_no_longer_takes_is_lost() -> None:
    """Another attempt completed the job meanwhile: the caller re-reads it."""
    assert FailOver(1, 2).next(False) == RaceLost()


def test_one_upstream_is_final() -> None:
    assert Try(0, 1).mode is FINAL


# --- hedged: the race ---------------------------------------------------------------------------

R3 = Race(3)  # one racer, on the first of three upstreams
R, U, L, E = RacerEnd.RELEASED, RacerEnd.UNKNOWN, RacerEnd.LOST, RacerEnd.STORE_ERROR
TWO = Race(3, started=2, racing=2)
WAIT_ROWS = [
    # No answer within hedge_after: the next upstream comes in (admitted), or the wait goes on.
    (Wait(R3, admitted=True), (), AddHedge(R3)),
    (Wait(Race(2, started=2), admitted=False), (), Wait(Race(2, started=2), admitted=False)),
    # Every racer failed: a release fails over at once, an unknown one settles the job.
    (Wait(R3, True), (R,), AddHedge(Race(3, racing=0, failures=(RELEASE,)))),
    (Wait(R3, True), (U,), SettleRace(0)),
    (Wait(TWO, True), (U, R), SettleRace(0)),
    (Wait(Race(2, 2, 2), False), (R, R), SettleRace(1)),
    (Wait(TWO, True), (R,), Wait(Race(3, 2, 1, (RELEASE,)), admitted=True)),
    # Once any racer may have executed, no further upstream comes in (SPEC §3.4).
    (Wait(TWO, True), (U,), Wait(Race(3, 2, 1, (UNKNOWN,)), admitted=False)),
    (Wait(TWO, True), (E,), Wait(Race(3, 2, 1, store_errors=1), admitted=False)),
    # A lost CAS: wait for the others (the winner may be this request's racer, streaming).
    (Wait(TWO, True), (L,), Wait(Race(3, 2, 1, lost=True), admitted=False)),
    # The sole racer lost: the next upstream admitted before the wait is still asked for (the
    # job, completed, refuses it: see HEDGE_ROWS); then the race is lost.
    (Wait(R3, True), (L,), AddHedge(Race(3, racing=0, lost=True))),
    (Wait(Race(2, 2, 2), False), (L, R), RaceLost()),
    (Wait(R3, True), (E,), RaceStoreError()),
    (Wait(TWO, True), (L, E), RaceLost()),  # another attempt's completion first
    (Wait(TWO, True), (U, E), RaceStoreError()),  # a store error before the failures
]


@pytest.mark.parametrize(("state", "ends", "expected"), WAIT_ROWS)
def test_a_wait_of_the_race(state: Wait, ends: tuple[RacerEnd, ...], expected: object) -> None:
    assert state.next(ends) == expected


HEDGE_ROWS = [
    (AddHedge(R3), True, Wait(Race(3, started=2, racing=2), admitted=True)),
    (AddHedge(Race(2)), True, Wait(Race(2, started=2, racing=2), admitted=False)),  # the last
    # The job stopped taking attempts (it completed): the race goes on, or ends.
    (AddHedge(R3), False, Wait(Race(3, started=2, racing=1), admitted=True)),
    (AddHedge(Race(2, racing=0, failures=(RELEASE,))), False, SettleRace(0)),
    (AddHedge(Race(3, racing=0, lost=True)), False, RaceLost()),
    # A store error: a 503 if nobody answers this client, else no 503 in a racer's answer.
    (AddHedge(Race(3, racing=0, failures=(RELEASE,))), None, RaceStoreError()),
    (AddHedge(R3), None, Wait(Race(3, started=4, racing=1, store_errors=1), admitted=False)),
]


@pytest.mark.parametrize(("state", "started", "expected"), HEDGE_ROWS)
def test_a_hedge(state: AddHedge, started: bool | None, expected: object) -> None:
    assert state.next(started) == expected


def test_a_racer_ends_by_its_outcome() -> None:
    assert racer_end(RELEASE) is R
    assert racer_end(UNKNOWN) is U


# --- the states are values ----------------------------------------------------------------------


def test_states_are_values_equal_by_class_and_fields() -> None:
    assert Try(0, 2) == Try(0, 2)
    other: object = FailOver(0, 2)
    assert Try(0, 2) != other  # same fields, another state
    assert hash(Race(3)) == hash(Race(3))
    assert {Lost(), Lost()} == {Lost()}


def test_states_are_frozen_for_the_type_checker() -> None:
    """mypy --strict (warn_unused_ignores) fails this file if the ignore is not needed: nothing
    assigns to a state's field once built (core/frozen.py)."""
    state = Try(0, 2)
    state.index = 1  # type: ignore[misc]
    assert not hasattr(state, "__dict__")  # slots: no attribute besides the fields
