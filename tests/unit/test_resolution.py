"""SPEC §3.6: the pure rules of unknown jobs that resolve themselves."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idemproxy.core.machine import Outcome, resend_outcome
from idemproxy.core.resolution import (
    Backoff,
    Question,
    Resend,
    ResendAsk,
    Verdict,
    Way,
    asked_attempts,
    first_sent,
    may_resend,
    never_executed,
    read_reconcile_answer,
    read_resend_answer,
    releasable,
)
from idemproxy.core.types import (
    Attempt,
    AttemptState,
    Evidence,
    Job,
    JobState,
    StoredResponse,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
UPSTREAM = "http://payments:8080"
FINGERPRINT = "f" * 64
QUESTION = Question("job-1", "k-1", 2, "POST", "/payments")


def answer(**fields: Any) -> bytes:
    return json.dumps({"job": "job-1", "attempt": 2, **fields}).encode()


def unknown_job(*attempts: Attempt) -> Job:
    if not attempts:
        attempts = (Attempt(1, UPSTREAM, AttemptState.UNKNOWN, started_at=T0),)
    return Job("job-1", "o", "k-1", FINGERPRINT, JobState.UNKNOWN, 3, len(attempts),
               attempts=attempts)  # fmt: skip


def test_executed_with_its_response_completes() -> None:
    body = answer(
        executed=True,
        response={"status": 201, "headers": [["Content-Type", "text/plain"]], "body": "ok"},
    )
    reading = read_reconcile_answer(QUESTION, 200, body)
    assert reading.verdict is Verdict.EXECUTED
    assert reading.response == StoredResponse(201, (("Content-Type", "text/plain"),), b"ok")


def test_executed_with_a_binary_body() -> None:
    coded = base64.b64encode(b"\x00\xff").decode()
    body = answer(executed=True, response={"status": 200, "body_base64": coded})
    reading = read_reconcile_answer(QUESTION, 200, body)
    assert reading.response == StoredResponse(200, (), b"\x00\xff")


def test_never_executed_must_be_explicit() -> None:
    assert read_reconcile_answer(QUESTION, 200, answer(executed=False)).verdict is (
        Verdict.NOT_EXECUTED
    )


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (None, None),  # timeout, reset
        (500, answer(executed=False)),
        (503, b""),
        (404, answer(executed=False)),
        (204, b""),
        (200, b"<html>"),
        (200, b"\xff\xfe"),
        (200, b"[]"),
        (200, b"null"),
        (200, answer()),
        (200, answer(executed=None)),
        (200, answer(executed="false")),
        (200, answer(executed=0)),
        (200, json.dumps({"job": "job-2", "attempt": 2, "executed": False}).encode()),
        (200, json.dumps({"job": "job-1", "attempt": 1, "executed": False}).encode()),
        (200, json.dumps({"job": "job-1", "attempt": "2", "executed": False}).encode()),
        (200, json.dumps({"job": "job-1", "attempt": 2.0, "executed": False}).encode()),
        (200, b'{"job": "job-1", "attempt": 2e0, "executed": false}'),
        (200, json.dumps({"job": "job-1", "attempt": [2], "executed": False}).encode()),
        (200, json.dumps({"executed": False}).encode()),
        (200, answer(executed=True)),
        (200, answer(executed=True, response={"status": 101})),
        (200, answer(executed=True, response={"status": True})),
        (200, answer(executed=True, response={"status": "200"})),
        (200, answer(executed=True, response={"status": 200, "headers": [["a"]]})),
        (200, answer(executed=True, response={"status": 200, "headers": {"a": "b"}})),
        (200, answer(executed=True, response={"status": 200, "body": "a", "body_base64": "YQ=="})),
        (200, answer(executed=True, response={"status": 200, "body_base64": "!!"})),
        (200, answer(executed=True, response={"status": 200, "body": 5})),
        # A member named twice: which one counts is the parser's choice (RFC 8259 §4).
        (200, b'{"job": "job-1", "attempt": 2, "executed": true, "executed": false}'),
        (200, b'{"job": "job-1", "attempt": 2, "executed": false, "executed": false}'),
        (200, b'{"job": "job-0", "job": "job-1", "attempt": 2, "executed": false}'),
        (200, b'{"job": "job-1", "attempt": 3, "attempt": 2, "executed": false}'),
        (
            200,
            b'{"job": "job-1", "attempt": 2, "executed": true, "response": '
            b'{"status": 500, "status": 200, "body": "ok"}}',
        ),
        (200, b'{"job": "job-1", "attempt": 2, "executed": false, "x": NaN}'),
    ],
)
def test_anything_else_proves_nothing(status: int | None, body: bytes | None) -> None:
    reading = read_reconcile_answer(QUESTION, status, body)
    assert reading.verdict is Verdict.UNKNOWN
    assert reading.response is None
    assert reading.reason


def test_true_names_no_attempt() -> None:
    """`true == 1` in Python: an answer with `"attempt": true` about attempt 1 proves nothing."""
    first = Question("job-1", "k-1", 1, "POST", "/payments")
    for named in (True, 1.0):
        body = json.dumps({"job": "job-1", "attempt": named, "executed": False}).encode()
        assert read_reconcile_answer(first, 200, body).verdict is Verdict.UNKNOWN
    body = json.dumps({"job": "job-1", "attempt": 1, "executed": False}).encode()
    assert read_reconcile_answer(first, 200, body).verdict is Verdict.NOT_EXECUTED


def test_questions_are_about_every_unknown_attempt() -> None:
    job = unknown_job(
        Attempt(1, UPSTREAM, AttemptState.UNKNOWN),
        Attempt(2, UPSTREAM, AttemptState.FAILED, 503),
        Attempt(3, UPSTREAM, AttemptState.UNKNOWN, 409),
    )
    assert [a.number for a in asked_attempts(job)] == [1, 3]
    assert asked_attempts(unknown_job(Attempt(1, UPSTREAM, AttemptState.FAILED))) == ()


def _answered(verdict: Verdict, way: Way = Way.RECONCILE) -> Evidence:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    return Evidence(way.value, at, at, 200, verdict.value, "")


def test_never_executed_is_read_from_reconcile_evidence() -> None:
    job = unknown_job(
        Attempt(1, UPSTREAM, AttemptState.UNKNOWN, evidence=(_answered(Verdict.UNKNOWN),)),
        Attempt(2, UPSTREAM, AttemptState.UNKNOWN, evidence=(_answered(Verdict.NOT_EXECUTED),)),
        Attempt(3, UPSTREAM, AttemptState.UNKNOWN,
                evidence=(_answered(Verdict.NOT_EXECUTED, Way.UPSTREAM_KEY),)),
    )  # fmt: skip
    assert never_executed(job) == {2}


def test_never_executed_releases_only_once_every_attempt_that_may_have_run_said_so() -> None:
    one = unknown_job(
        Attempt(1, UPSTREAM, AttemptState.FAILED), Attempt(2, UPSTREAM, AttemptState.UNKNOWN)
    )
    assert releasable(one, frozenset({2}))
    assert not releasable(one, frozenset())
    hedged = unknown_job(
        Attempt(1, UPSTREAM, AttemptState.UNKNOWN), Attempt(2, "http://b", AttemptState.UNKNOWN)
    )
    assert not releasable(hedged, frozenset({2}))
    assert releasable(hedged, frozenset({1, 2}))
    assert not releasable(one._replace(state=JobState.COMPLETED), frozenset({2}))


def test_backoff_doubles_up_to_its_longest_after_each_answer_was_due() -> None:
    backoff = Backoff(5.0, 60.0, answer_within=2.0)
    assert backoff.due_after(0) == 5
    assert [backoff.due_after(n) for n in (1, 2, 3, 4, 10_000)] == [12, 22, 42, 62, 62]


def ask(**changes: Any) -> ResendAsk:
    fields: dict[str, Any] = {
        "fingerprint": FINGERPRINT, "sent": "s1", "upstream": UPSTREAM,
        "now": T0 + timedelta(minutes=5),
    }  # fmt: skip
    fields.update(changes)
    return ResendAsk(**fields)


def sent(number: int, state: AttemptState, *, at: datetime = T0, **changes: Any) -> Attempt:
    fields: dict[str, Any] = {"upstream": UPSTREAM, "started_at": at, "sent_digest": "s1"}
    fields.update(changes)
    return Attempt(number, state=state, **fields)


SENT_ONCE = unknown_job(sent(1, AttemptState.UNKNOWN))


def test_resend_within_the_window_of_the_same_request_to_the_same_upstream() -> None:
    assert may_resend(SENT_ONCE, ask(), window=3600) is Resend.ALLOWED
    # Again after a resend that proved nothing: the window still counts from the first send.
    twice = unknown_job(
        sent(1, AttemptState.UNKNOWN), sent(2, AttemptState.UNKNOWN, at=T0 + timedelta(hours=1))
    )
    assert may_resend(twice, ask(now=T0 + timedelta(minutes=61)), window=3600) is (
        Resend.WINDOW_PASSED
    )
    assert may_resend(twice, ask(), window=3600) is Resend.ALLOWED
    # A first attempt that failed (connect refused) never reached the upstream.
    after_failure = unknown_job(
        sent(1, AttemptState.FAILED, at=T0 - timedelta(days=3), sent_digest=None),
        sent(2, AttemptState.UNKNOWN),
    )
    assert may_resend(after_failure, ask(), window=3600) is Resend.ALLOWED
    assert first_sent(after_failure) == after_failure.attempts[1]


@pytest.mark.parametrize(
    ("job", "request_", "window", "expected"),
    [
        (SENT_ONCE, ask(), None, Resend.NOT_DECLARED),
        (SENT_ONCE._replace(state=JobState.RELEASED), ask(), 3600, Resend.NOT_UNKNOWN),
        (unknown_job(sent(1, AttemptState.FAILED)), ask(), 3600, Resend.NO_ATTEMPT),
        (SENT_ONCE, ask(now=T0 + timedelta(hours=1)), 3600, Resend.WINDOW_PASSED),
        (unknown_job(sent(1, AttemptState.UNKNOWN, started_at=None)), ask(), 3600,
         Resend.WINDOW_PASSED),
        (SENT_ONCE, ask(sent="s2"), 3600, Resend.DIFFERENT_REQUEST),
        (unknown_job(sent(1, AttemptState.UNKNOWN, sent_digest=None)), ask(), 3600,
         Resend.DIFFERENT_REQUEST),
        (SENT_ONCE, ask(fingerprint="0" * 64), 3600, Resend.DIFFERENT_REQUEST),
        (SENT_ONCE, ask(upstream="http://fallback"), 3600, Resend.DIFFERENT_UPSTREAM),
        (
            unknown_job(
                sent(1, AttemptState.UNKNOWN), sent(2, AttemptState.UNKNOWN, upstream="http://b")
            ),
            ask(),
            3600,
            Resend.DIFFERENT_UPSTREAM,
        ),
    ],
)  # fmt: skip
def test_resend_refused(
    job: Job, request_: ResendAsk, window: float | None, expected: Resend
) -> None:
    assert may_resend(job, request_, window=window) is expected


@pytest.mark.parametrize("status", [200, 201, 400, 402, 404, 422])
def test_a_final_answer_to_the_resend_completes(status: int) -> None:
    assert read_resend_answer(status) is Verdict.EXECUTED
    assert resend_outcome(status) is Outcome.COMPLETE


@pytest.mark.parametrize("status", [None, 408, 409, 425, 429, 500, 502, 503, 504])
def test_an_answer_that_proves_nothing_leaves_it_unknown(status: int | None) -> None:
    assert read_resend_answer(status) is Verdict.UNKNOWN
    assert resend_outcome(status) is Outcome.UNKNOWN
