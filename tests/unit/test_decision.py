"""SPEC §2.3, §3.1, §11: the pure decision of what to do with a job."""

from __future__ import annotations

import itertools

import pytest

from idemproxy.core.decision import (
    AskAbout,
    Decision,
    Forget,
    Hold,
    Policy,
    Reject,
    Replay,
    StartNextAttempt,
    Unsent,
    decide,
    unsent_claim,
)
from idemproxy.core.types import Job, JobState, StoredResponse
from idemproxy.errors import OutcomeUnknown, PayloadMismatch, RequestInFlight

FINGERPRINT = "f" * 64
OTHER_FINGERPRINT = "0" * 64
VERSION = 7
RESPONSE = StoredResponse(
    status=201, headers=(("Content-Type", "application/json"), ("Location", "/p/1")), body=b"{}"
)
HOLD = Policy(hold_in_flight=True)
IETF = Policy(hold_in_flight=False)


def make_job(
    state: JobState,
    *,
    expired: bool = False,
    version: int = VERSION,
    fingerprint: str = FINGERPRINT,
    response: StoredResponse | None = None,
) -> Job:
    if response is None and state is JobState.COMPLETED:
        response = RESPONSE
    return Job(
        id="job-1",
        owner="owner-hash",
        key="key-1",
        fingerprint=fingerprint,
        state=state,
        version=version,
        attempt_count=1,
        method="POST",
        path="/v1/payments",
        completed_by=1 if state is JobState.COMPLETED else None,
        response=response,
        expired=expired,
    )


# --- the full matrix ----------------------------------------------------------------------------


def expected_decision(
    state: JobState, matches: bool, hold: bool, wait_expired: bool, expired: bool
) -> Decision:
    """SPEC §2.3 and §11, written as a table rather than as code paths."""
    if expired and state in (JobState.COMPLETED, JobState.RELEASED):
        return Forget(VERSION)  # an expired job is gone; in_flight/unknown are never swept early
    if not matches:
        return Reject(PayloadMismatch)  # whatever the state: the stored job is untouched
    by_state: dict[JobState, Decision] = {
        JobState.COMPLETED: Replay(RESPONSE),
        JobState.RELEASED: StartNextAttempt(VERSION),
        JobState.UNKNOWN: Reject(OutcomeUnknown),
        JobState.IN_FLIGHT: Hold() if hold and not wait_expired else Reject(RequestInFlight),
    }
    return by_state[state]


MATRIX = [
    pytest.param(
        state,
        matches,
        hold,
        wait_expired,
        expired,
        id="-".join(
            [
                state.value,
                "match" if matches else "mismatch",
                "hold" if hold else "ietf",
                "wait_expired" if wait_expired else "waiting",
                "expired" if expired else "live",
            ]
        ),
    )
    for state, matches, hold, wait_expired, expired in itertools.product(
        JobState, [True, False], [True, False], [False, True], [False, True]
    )
]


@pytest.mark.parametrize(("state", "matches", "hold", "wait_expired", "expired"), MATRIX)
def test_decide_matrix(
    state: JobState, matches: bool, hold: bool, wait_expired: bool, expired: bool
) -> None:
    job = make_job(state, expired=expired)
    decision = decide(
        job,
        FINGERPRINT if matches else OTHER_FINGERPRINT,
        HOLD if hold else IETF,
        wait_expired=wait_expired,
    )
    assert decision == expected_decision(state, matches, hold, wait_expired, expired)


def test_matrix_covers_every_state() -> None:
    assert len(MATRIX) == len(JobState) * 16


# --- the same rules, spelled out ---------------------------------------------------------------


def test_completed_replays_the_stored_response() -> None:
    decision = decide(make_job(JobState.COMPLETED), FINGERPRINT, HOLD)
    assert isinstance(decision, Replay)
    assert decision.response is RESPONSE


def test_completed_with_omitted_body_replays_without_re_executing() -> None:
    omitted = StoredResponse(status=200, headers=(), body=None)
    decision = decide(make_job(JobState.COMPLETED, response=omitted), FINGERPRINT, HOLD)
    assert decision == Replay(omitted)
    assert decision.response.omitted


@pytest.mark.parametrize("state", list(JobState), ids=str)
def test_different_fingerprint_is_payload_mismatch(state: JobState) -> None:
    assert decide(make_job(state), OTHER_FINGERPRINT, HOLD) == Reject(PayloadMismatch)
    assert decide(make_job(state), OTHER_FINGERPRINT, IETF) == Reject(PayloadMismatch)


def test_a_job_stored_before_fingerprint_headers_matches_the_earlier_fingerprint() -> None:
    """SPEC §6: with `fingerprint_headers` set, a job stored before holds the fingerprint the
    request had without the headers' field (`earlier`): its retries still replay. Any other
    fingerprint is still a mismatch."""
    completed = make_job(JobState.COMPLETED)
    assert decide(completed, OTHER_FINGERPRINT, HOLD, earlier=FINGERPRINT) == Replay(RESPONSE)
    assert decide(completed, OTHER_FINGERPRINT, HOLD, earlier="1" * 64) == Reject(PayloadMismatch)
    assert decide(completed, FINGERPRINT, HOLD, earlier="1" * 64) == Replay(RESPONSE)


def test_released_starts_the_next_attempt_by_cas_on_its_version() -> None:
    assert decide(make_job(JobState.RELEASED, version=42), FINGERPRINT, HOLD) == StartNextAttempt(
        42
    )


def test_unknown_is_rejected_until_resolved() -> None:
    for policy in (HOLD, IETF):
        for wait_expired in (False, True):
            decision = decide(
                make_job(JobState.UNKNOWN), FINGERPRINT, policy, wait_expired=wait_expired
            )
            assert decision == Reject(OutcomeUnknown)


def test_in_flight_is_held_by_default() -> None:
    assert decide(make_job(JobState.IN_FLIGHT), FINGERPRINT, HOLD) == Hold()
    assert decide(make_job(JobState.IN_FLIGHT), FINGERPRINT, Policy()) == Hold()


def test_in_flight_after_max_wait_is_request_in_flight() -> None:
    decision = decide(make_job(JobState.IN_FLIGHT), FINGERPRINT, HOLD, wait_expired=True)
    assert decision == Reject(RequestInFlight)
    assert RequestInFlight.retry_after is not None


def test_in_flight_in_the_ietf_profile_is_rejected_at_once() -> None:
    assert decide(make_job(JobState.IN_FLIGHT), FINGERPRINT, IETF) == Reject(RequestInFlight)


@pytest.mark.parametrize("state", [JobState.COMPLETED, JobState.RELEASED], ids=str)
@pytest.mark.parametrize("fingerprint", [FINGERPRINT, OTHER_FINGERPRINT], ids=["match", "mismatch"])
def test_expired_terminal_jobs_are_forgotten_by_cas_on_their_version(
    state: JobState, fingerprint: str
) -> None:
    job = make_job(state, expired=True, version=13)
    assert decide(job, fingerprint, HOLD) == Forget(13)
    assert decide(job, fingerprint, IETF, wait_expired=True) == Forget(13)


def test_expired_in_flight_job_is_not_forgotten() -> None:
    job = make_job(JobState.IN_FLIGHT, expired=True)
    assert decide(job, FINGERPRINT, HOLD) == Hold()
    assert decide(job, FINGERPRINT, IETF) == Reject(RequestInFlight)
    assert decide(job, OTHER_FINGERPRINT, HOLD) == Reject(PayloadMismatch)


def test_expired_unknown_job_is_not_forgotten() -> None:
    job = make_job(JobState.UNKNOWN, expired=True)
    assert decide(job, FINGERPRINT, HOLD) == Reject(OutcomeUnknown)
    assert decide(job, OTHER_FINGERPRINT, HOLD) == Reject(PayloadMismatch)


def test_decide_does_not_modify_the_job() -> None:
    job = make_job(JobState.RELEASED)
    before = make_job(JobState.RELEASED)
    decide(job, FINGERPRINT, HOLD)
    assert job == before


# --- a claim the proxy gave up on (proxy/background/unsent.py)
# -------------------------------------------


def test_an_unsent_claim_not_committed_yet_is_looked_for_again() -> None:
    assert unsent_claim(None, "job-1") is Unsent.NOT_YET


def test_an_unsent_claim_committed_untouched_is_released() -> None:
    assert unsent_claim(make_job(JobState.IN_FLIGHT, version=1), "job-1") is Unsent.RELEASE


@pytest.mark.parametrize(
    "job",
    [
        make_job(JobState.IN_FLIGHT, version=1),  # another claim's job holds the key
    ],
)
def test_another_claims_job_is_never_released(job: Job) -> None:
    assert unsent_claim(job, "job-2") is Unsent.MOVED_ON


@pytest.mark.parametrize(
    "job",
    [
        make_job(JobState.UNKNOWN, version=2),  # taken over: only a resolution ends it (§3.3)
        make_job(JobState.IN_FLIGHT, version=2),  # in flight again under a newer version
        make_job(JobState.IN_FLIGHT, version=1)._replace(attempt_count=2),  # an attempt added
        make_job(JobState.RELEASED, version=2),
        make_job(JobState.COMPLETED, version=2),
    ],
    ids=["unknown", "newer-version", "more-attempts", "released", "completed"],
)
def test_an_unsent_claims_job_that_moved_on_is_left_alone(job: Job) -> None:
    assert unsent_claim(job, "job-1") is Unsent.MOVED_ON


# --- a next attempt the proxy gave up on (start_next_attempt, fail_over; SPEC §3.4) ------------
_TOKEN = "00000000-0000-7000-8000-000000000001"


def _next(job: Job) -> Unsent:
    """What the follow-up of a statement that would move the job to version 3, attempt 2 says."""
    return unsent_claim(job, "job-1", version=3, attempt=2, token=_TOKEN)


def test_a_next_attempt_committed_untouched_is_released() -> None:
    started = make_job(JobState.IN_FLIGHT, version=3)._replace(attempt_count=2, started_by=_TOKEN)
    assert _next(started) is Unsent.RELEASE


def test_a_next_attempt_not_committed_yet_is_looked_for_again() -> None:
    before = make_job(JobState.RELEASED, version=2)._replace(attempt_count=1)
    assert _next(before) is Unsent.NOT_YET


@pytest.mark.parametrize(
    "job",
    [
        # another retry's statement won the same CAS: its attempt is running
        make_job(JobState.IN_FLIGHT, version=3)._replace(attempt_count=2, started_by="other"),
        make_job(JobState.IN_FLIGHT, version=3)._replace(attempt_count=2),
        make_job(JobState.UNKNOWN, version=4)._replace(attempt_count=2, started_by=_TOKEN),
        make_job(JobState.IN_FLIGHT, version=4)._replace(attempt_count=3, started_by=_TOKEN),
    ],
    ids=["another-retry", "no-token", "taken-over", "failed-over-since"],
)
def test_a_next_attempt_that_is_not_ours_or_moved_on_is_left_alone(job: Job) -> None:
    assert _next(job) is Unsent.MOVED_ON


def test_an_unknown_job_is_asked_about_once_when_its_route_can() -> None:
    """SPEC §3.6: then decided again; without `ask`, 409 outcome-unknown as before."""
    job = make_job(JobState.UNKNOWN)
    assert decide(job, FINGERPRINT, HOLD, ask=True) == AskAbout(VERSION)
    assert decide(job, FINGERPRINT, HOLD) == Reject(OutcomeUnknown)
    # The fingerprint is compared first: another payload is never asked about.
    assert decide(job, OTHER_FINGERPRINT, HOLD, ask=True) == Reject(PayloadMismatch)
    for state in (JobState.COMPLETED, JobState.RELEASED, JobState.IN_FLIGHT):
        response = RESPONSE if state is JobState.COMPLETED else None
        other = make_job(state, response=response)
        assert not isinstance(decide(other, FINGERPRINT, HOLD, ask=True), AskAbout)
