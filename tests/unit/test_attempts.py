"""SPEC §3.2, §3.4: what an attempt's result means (core/machine.py), and the rules of a
race (core/attempt_order.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idemproxy.constants import DEFAULT_RELEASE_STATUSES, DEFAULT_UNKNOWN_STATUSES
from idemproxy.core.attempt_order import (
    RaceEnd,
    brings_in_next,
    may_hedge,
    none_executed,
    race_end,
    race_outcome,
    settling_index,
)
from idemproxy.core.machine import (
    Failure,
    Handling,
    Mode,
    Outcome,
    StatusPolicy,
    checks_contract,
    classify_breach,
    classify_cut_off,
    classify_failure,
    classify_response,
    completes_before_head,
    handed_back,
    moves_on,
    order_mode,
    response_handling,
    settled_state,
)
from idemproxy.core.types import JobState
from idemproxy.errors import ContractViolation, UpstreamTimeout, UpstreamUnavailable

DEFAULT_STATUSES = StatusPolicy(DEFAULT_RELEASE_STATUSES, DEFAULT_UNKNOWN_STATUSES)
FAILED = [Outcome.RELEASE, Outcome.UNKNOWN]  # what a failed attempt's outcome can be


# --- attempt outcomes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        *[pytest.param(status, Outcome.RELEASE, id=str(status)) for status in (408, 425, 429, 503)],
        *[pytest.param(status, Outcome.UNKNOWN, id=str(status)) for status in (502, 504)],
        *[
            pytest.param(status, Outcome.COMPLETE, id=str(status))
            for status in (
                100, 200, 201, 202, 204, 301, 302, 304, 307,
                400, 401, 403, 404, 405, 409, 410, 422, 451,
                500, 501, 505, 507, 511, 599,
            )
        ],
    ],
)  # fmt: skip
def test_classify_response_with_the_default_lists(status: int, outcome: Outcome) -> None:
    assert classify_response(status, DEFAULT_STATUSES) is outcome


def test_default_status_lists_match_the_spec() -> None:
    assert set(DEFAULT_RELEASE_STATUSES) == {408, 425, 429, 503}
    assert set(DEFAULT_UNKNOWN_STATUSES) == {502, 504}


@given(st.integers(min_value=100, max_value=599))
def test_every_unlisted_status_completes(status: int) -> None:
    expected = (
        Outcome.RELEASE
        if status in DEFAULT_RELEASE_STATUSES
        else Outcome.UNKNOWN
        if status in DEFAULT_UNKNOWN_STATUSES
        else Outcome.COMPLETE
    )
    assert classify_response(status, DEFAULT_STATUSES) is expected


def test_classify_response_uses_the_configured_lists() -> None:
    policy = StatusPolicy(release_statuses=frozenset({500}), unknown_statuses=[418])
    assert classify_response(500, policy) is Outcome.RELEASE
    assert classify_response(418, policy) is Outcome.UNKNOWN
    assert classify_response(503, policy) is Outcome.COMPLETE
    assert classify_response(504, policy) is Outcome.COMPLETE


def test_classify_response_with_empty_lists_always_completes() -> None:
    policy = StatusPolicy(release_statuses=(), unknown_statuses=())
    for status in (408, 429, 502, 503, 504):
        assert classify_response(status, policy) is Outcome.COMPLETE


@pytest.mark.parametrize(
    ("failure", "outcome", "problem"),
    [
        pytest.param(Failure.CONNECT, Outcome.RELEASE, UpstreamUnavailable, id="connect"),
        pytest.param(Failure.TIMEOUT, Outcome.UNKNOWN, UpstreamTimeout, id="timeout"),
        pytest.param(Failure.BROKEN, Outcome.UNKNOWN, UpstreamUnavailable, id="broken"),
    ],
)
def test_classify_failure(failure: Failure, outcome: Outcome, problem: type) -> None:
    assert classify_failure(failure) == (outcome, problem)


def test_classify_failure_covers_every_failure() -> None:
    for failure in Failure:
        outcome, problem = classify_failure(failure)
        assert outcome in (Outcome.RELEASE, Outcome.UNKNOWN)
        assert problem.status in (502, 504)


def test_only_a_connect_failure_releases() -> None:
    """SPEC §3.2: once a request byte may have been written, the outcome is unknown."""
    released = [failure for failure in Failure if classify_failure(failure)[0] is Outcome.RELEASE]
    assert released == [Failure.CONNECT]


def test_a_contract_breach_is_unknown_never_a_release() -> None:
    """SPEC §3.4: a 2xx proves the upstream acted, whatever its body."""
    assert classify_breach() == (Outcome.UNKNOWN, ContractViolation)
    assert not moves_on(classify_breach()[0])


def test_only_a_release_moves_on_to_another_attempt() -> None:
    assert [outcome for outcome in Outcome if moves_on(outcome)] == [Outcome.RELEASE]


@given(st.lists(st.sampled_from([Outcome.RELEASE, Outcome.UNKNOWN])))
def test_a_race_is_released_only_when_no_racer_may_have_executed(outcomes: list[Outcome]) -> None:
    expected = Outcome.UNKNOWN if Outcome.UNKNOWN in outcomes else Outcome.RELEASE
    assert race_outcome(outcomes) is expected


def test_a_cut_off_attempt_is_unknown() -> None:
    """SPEC §3.2: cut off by shutdown, or its body broken off after the head."""
    assert classify_cut_off() is Outcome.UNKNOWN
    assert not moves_on(classify_cut_off())


# --- which mode hands a failure back --------------------------------------------------------------

# SPEC §3.4, written as a table: the caller decides on a released outcome when it may fail over,
# and on every failure in a race; the last option settles the job itself.
HANDED_BACK = {
    (Outcome.COMPLETE, Mode.FINAL): False,
    (Outcome.COMPLETE, Mode.FAIL_OVER): False,
    (Outcome.COMPLETE, Mode.HEDGED): False,
    (Outcome.RELEASE, Mode.FINAL): False,
    (Outcome.RELEASE, Mode.FAIL_OVER): True,
    (Outcome.RELEASE, Mode.HEDGED): True,
    (Outcome.UNKNOWN, Mode.FINAL): False,
    (Outcome.UNKNOWN, Mode.FAIL_OVER): False,  # an unknown outcome never fails over
    (Outcome.UNKNOWN, Mode.HEDGED): True,
}
OUTCOME_BY_MODE = [
    pytest.param(outcome, mode, id=f"{outcome.value}-{mode.value}")
    for outcome, mode in itertools.product(Outcome, Mode)
]


def test_the_hand_back_table_covers_every_outcome_and_mode() -> None:
    assert set(HANDED_BACK) == set(itertools.product(Outcome, Mode))


@pytest.mark.parametrize(("outcome", "mode"), OUTCOME_BY_MODE)
def test_handed_back(outcome: Outcome, mode: Mode) -> None:
    assert handed_back(outcome, mode) is HANDED_BACK[outcome, mode]


@pytest.mark.parametrize(("outcome", "mode"), OUTCOME_BY_MODE)
@pytest.mark.parametrize("event_stream", [False, True], ids=["body", "event-stream"])
@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
def test_a_failure_handed_back_is_not_carried_on(
    outcome: Outcome, mode: Mode, event_stream: bool, gated: bool
) -> None:
    handling = response_handling(outcome, mode, event_stream=event_stream, gated=gated)
    if not HANDED_BACK[outcome, mode]:
        assert handling in (Handling.STREAM, Handling.CAPTURE)
    elif mode is Mode.HEDGED:
        assert handling is Handling.HAND_BACK_WITH_REPLY  # it may be the race's last answer
    else:
        assert handling is Handling.HAND_BACK  # the next upstream answers instead


@pytest.mark.parametrize(
    ("outcome", "mode"),
    [
        pytest.param(outcome, mode, id=f"{outcome.value}-{mode.value}")
        for outcome, mode in HANDED_BACK
        if not HANDED_BACK[outcome, mode]
    ],
)
def test_an_event_stream_streams_unless_raced_or_gated(outcome: Outcome, mode: Mode) -> None:
    """SPEC §2 step 4; a race's winner must be decided before a byte goes out, and a contract
    gate needs the whole body (§3.4)."""
    assert response_handling(outcome, mode, event_stream=True, gated=False) is (
        Handling.CAPTURE if mode is Mode.HEDGED else Handling.STREAM
    )
    assert response_handling(outcome, mode, event_stream=True, gated=True) is Handling.CAPTURE
    assert response_handling(outcome, mode, event_stream=False, gated=False) is Handling.CAPTURE
    assert response_handling(outcome, mode, event_stream=False, gated=True) is Handling.CAPTURE


def test_only_a_response_that_would_complete_is_checked_against_the_contract() -> None:
    assert [outcome for outcome in Outcome if checks_contract(outcome)] == [Outcome.COMPLETE]


@pytest.mark.parametrize(("outcome", "mode"), OUTCOME_BY_MODE)
def test_only_a_racer_completes_before_its_head_goes_out(outcome: Outcome, mode: Mode) -> None:
    expected = outcome is Outcome.COMPLETE and mode is Mode.HEDGED
    assert completes_before_head(outcome, mode) is expected


# --- what a failure settles the job in ------------------------------------------------------------


def test_a_released_outcome_settles_the_job_released() -> None:
    assert settled_state(Outcome.RELEASE) is JobState.RELEASED


def test_an_unknown_outcome_settles_the_job_unknown() -> None:
    assert settled_state(Outcome.UNKNOWN) is JobState.UNKNOWN


def test_a_complete_outcome_does_not_settle() -> None:
    with pytest.raises(ValueError, match="completes its job"):
        settled_state(Outcome.COMPLETE)


@pytest.mark.parametrize("failure", list(Failure), ids=lambda failure: failure.value)
def test_every_failure_settles_in_a_state_of_its_outcome(failure: Failure) -> None:
    outcome, _ = classify_failure(failure)
    assert settled_state(outcome) is (
        JobState.RELEASED if failure is Failure.CONNECT else JobState.UNKNOWN
    )


def test_a_contract_breach_settles_the_job_unknown() -> None:
    assert settled_state(classify_breach()[0]) is JobState.UNKNOWN


# --- upstreams in order ---------------------------------------------------------------------------


@pytest.mark.parametrize("upstreams", [1, 2, 3, 5])
def test_only_the_last_upstream_in_order_is_final(upstreams: int) -> None:
    modes = [order_mode(index, upstreams) for index in range(upstreams)]
    assert modes == [Mode.FAIL_OVER] * (upstreams - 1) + [Mode.FINAL]


# --- hedging: may another upstream come in --------------------------------------------------------


def test_nothing_executed_before_any_racer_ended() -> None:
    assert none_executed([], store_errors=False)


def test_released_racers_executed_nothing() -> None:
    assert none_executed([Outcome.RELEASE, Outcome.RELEASE], store_errors=False)


def test_an_unknown_racer_may_have_executed() -> None:
    assert not none_executed([Outcome.RELEASE, Outcome.UNKNOWN], store_errors=False)


def test_a_racer_with_a_store_error_may_have_executed() -> None:
    """Its outcome was not written, or its answer not stored: the race does not know it."""
    assert not none_executed([], store_errors=True)
    assert not none_executed([Outcome.RELEASE], store_errors=True)


@given(st.lists(st.sampled_from(FAILED)), st.booleans())
def test_none_executed_only_when_every_racer_was_released(
    outcomes: list[Outcome], store_errors: bool
) -> None:
    expected = not store_errors and Outcome.UNKNOWN not in outcomes
    assert none_executed(outcomes, store_errors=store_errors) is expected


def test_a_hedge_is_admitted_while_an_upstream_is_left() -> None:
    assert may_hedge(started=1, upstreams=2, lost=False, none_executed=True)
    assert may_hedge(started=2, upstreams=3, lost=False, none_executed=True)


def test_no_hedge_once_every_upstream_has_a_racer() -> None:
    assert not may_hedge(started=2, upstreams=2, lost=False, none_executed=True)
    assert not may_hedge(started=3, upstreams=2, lost=False, none_executed=True)


def test_no_hedge_once_a_racer_lost_the_completion() -> None:
    """Another attempt completed the job: a new one would run on a completed job."""
    assert not may_hedge(started=1, upstreams=3, lost=True, none_executed=True)


def test_no_hedge_once_a_racer_may_have_executed() -> None:
    """SPEC §3.4: neither by the hedge timer nor as a fail-over."""
    assert not may_hedge(started=1, upstreams=3, lost=False, none_executed=False)


def test_the_next_upstream_comes_in_when_nobody_answered_within_hedge_after() -> None:
    assert brings_in_next(admitted=True, none_executed=True, timed_out=True, racing=True)


def test_the_next_upstream_comes_in_when_every_racer_failed_released() -> None:
    assert brings_in_next(admitted=True, none_executed=True, timed_out=False, racing=False)


def test_no_upstream_comes_in_while_the_others_still_race_after_a_failure() -> None:
    """A racer ended (released) before hedge_after while another still runs: wait on."""
    assert not brings_in_next(admitted=True, none_executed=True, timed_out=False, racing=True)


def test_no_upstream_comes_in_unless_admitted_before_the_wait() -> None:
    for timed_out, racing in itertools.product([False, True], repeat=2):
        assert not brings_in_next(
            admitted=False, none_executed=True, timed_out=timed_out, racing=racing
        )


def test_no_upstream_comes_in_after_a_racer_that_may_have_executed_ended() -> None:
    for timed_out, racing in itertools.product([False, True], repeat=2):
        assert not brings_in_next(
            admitted=True, none_executed=False, timed_out=timed_out, racing=racing
        )


# --- how a race without a winner ends -------------------------------------------------------------


def test_a_race_with_a_lost_completion_rereads_the_job() -> None:
    assert race_end(lost=True, store_errors=False) is RaceEnd.LOST
    assert race_end(lost=True, store_errors=True) is RaceEnd.LOST  # the job has its response


def test_a_race_with_a_store_error_cannot_settle() -> None:
    assert race_end(lost=False, store_errors=True) is RaceEnd.STORE_ERROR


def test_a_race_whose_racers_all_failed_settles_the_job() -> None:
    assert race_end(lost=False, store_errors=False) is RaceEnd.ALL_FAILED


@pytest.mark.parametrize(
    ("outcomes", "index"),
    [
        pytest.param([Outcome.RELEASE], 0, id="one-released"),
        pytest.param([Outcome.UNKNOWN], 0, id="one-unknown"),
        pytest.param([Outcome.RELEASE, Outcome.RELEASE], 1, id="the-last-released"),
        pytest.param([Outcome.UNKNOWN, Outcome.RELEASE], 0, id="the-unknown-one"),
        pytest.param(
            [Outcome.RELEASE, Outcome.UNKNOWN, Outcome.RELEASE, Outcome.UNKNOWN, Outcome.RELEASE],
            3,
            id="the-last-unknown",
        ),
    ],
)
def test_the_failure_that_settles_a_race(outcomes: list[Outcome], index: int) -> None:
    assert settling_index(outcomes) == index


def test_a_race_without_failures_has_none_to_settle_with() -> None:
    with pytest.raises(ValueError, match="had failures"):
        settling_index([])


@given(st.lists(st.sampled_from(FAILED), min_size=1))
def test_the_settling_failure_has_the_race_outcome(outcomes: list[Outcome]) -> None:
    """SPEC §3.4: the job ends unknown if any racer may have executed, else released, and the
    settling failure's outcome is that one (its answer goes to the client)."""
    index = settling_index(outcomes)
    assert outcomes[index] is race_outcome(outcomes)
    assert all(later is not outcomes[index] for later in outcomes[index + 1 :])
