"""What an answer means, and how long to wait before asking again (SPEC §3.2, §8, §14)."""

from __future__ import annotations

import io
import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from rich.console import Console

from idemproxy.batch.outcome import (
    Verdict,
    backoff_seconds,
    classify,
    may_have_executed,
    next_delay,
    problem_advice,
    problem_standing,
    retry_after_seconds,
    settles,
)
from idemproxy.batch.progress import PlainReporter, RichReporter, describe_problem
from idemproxy.batch.records import Outcome

from .factory import record


@pytest.mark.parametrize(
    ("status", "code", "verdict"),
    [
        (200, None, Verdict.DONE),
        (201, None, Verdict.DONE),
        (302, None, Verdict.DONE),
        (400, None, Verdict.FAILED),
        (401, None, Verdict.FAILED),
        (422, None, Verdict.FAILED),
        (500, None, Verdict.FAILED),  # stored and replayed by the proxy: asking again is futile
        (409, "payload-mismatch", Verdict.FAILED),
        (409, "outcome-unknown", Verdict.UNKNOWN),
        (409, "request-in-flight", Verdict.RETRY),
        (409, None, Verdict.RETRY),
        (429, None, Verdict.RETRY),
        (408, None, Verdict.RETRY),
        (503, "store-unavailable", Verdict.RETRY),
        (503, None, Verdict.RETRY),
        (502, "upstream-unavailable", Verdict.RETRY),
        (504, "upstream-timeout", Verdict.RETRY),
    ],
)
def test_classify(status: int, code: str | None, verdict: Verdict) -> None:
    assert classify(status, code) is verdict


@pytest.mark.parametrize(
    ("status", "code", "advice", "verdict"),
    [
        (504, "upstream-timeout", "never", Verdict.UNKNOWN),  # the status alone says retry
        (502, "upstream-unavailable", "never", Verdict.UNKNOWN),
        (502, "upstream-unavailable", "same-key", Verdict.RETRY),
        (429, "quota-exceeded", "same-key", Verdict.RETRY),
        (409, "payload-mismatch", "new-key-safe", Verdict.FAILED),
        (400, "key-invalid", "new-key-safe", Verdict.FAILED),
        (409, "outcome-unknown", "never", Verdict.UNKNOWN),
        # An upstream's own answer (no Idempotency-Error) is never taken for the proxy's.
        (503, None, "never", Verdict.RETRY),
        # An advice nobody defined is ignored: the status decides, as before.
        (503, "store-unavailable", "maybe", Verdict.RETRY),
    ],
)
def test_the_problems_retry_advice_decides(
    status: int, code: str | None, advice: str, verdict: Verdict
) -> None:
    assert classify(status, code, advice=advice) is verdict


@pytest.mark.parametrize(
    ("body", "advice"),
    [
        (b'{"code": "x", "retry": "never"}', "never"),
        (b'{"retry": "same-key"}', "same-key"),
        (b'{"retry": "soon"}', None),
        (b'{"retry": 1}', None),
        (b"[1]", None),
        (b"not json", None),
        (b'{"retry": "\xff', None),
        (b"\xff\xfe", None),
    ],
)
def test_problem_advice(body: bytes, advice: str | None) -> None:
    assert problem_advice(body) == advice


def test_retry_after_in_seconds_and_as_a_date() -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(format_datetime(now + timedelta(seconds=7), True), now) == 7.0
    assert retry_after_seconds(format_datetime(now - timedelta(seconds=7), True), now) == 0.0
    assert retry_after_seconds("100000") == 300.0
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds(None) is None


def test_backoff_grows_with_jitter_up_to_the_cap() -> None:
    rng = random.Random(1)
    for retry, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (10, 30.0)]:
        delays = [backoff_seconds(retry, 0.5, 30.0, rng) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1


def test_retry_after_is_the_least_wait() -> None:
    assert next_delay(1, 7.0, 0.5, 30.0) == 7.0
    assert 4.0 <= next_delay(5, 1.0, 0.5, 30.0) <= 8.0
    assert next_delay(1, None, 0.5, 30.0) <= 0.5


@pytest.mark.parametrize(
    ("status", "omitted", "verdict"),
    [
        (409, False, Verdict.FAILED),  # the upstream's own 409, stored: asking again replays it
        (503, False, Verdict.FAILED),
        (429, False, Verdict.FAILED),
        (201, False, Verdict.DONE),
        (201, True, Verdict.OMITTED),  # SPEC §7: replayed without the body it did not store
        (422, True, Verdict.OMITTED),
    ],
)
def test_a_replay_is_a_final_answer(status: int, omitted: bool, verdict: Verdict) -> None:
    assert classify(status, None, replayed=True, omitted=omitted) is verdict


@pytest.mark.parametrize("value", ["²", "١٢", "Mon, 99 Foo 2025 99:99:99 GMT", "\udcff"])
def test_a_retry_after_nobody_can_read_is_ignored(value: str) -> None:
    assert retry_after_seconds(value) is None


def test_progress_reports_omitted_items() -> None:
    omitted = record("a", Outcome.OMITTED, status=201, replayed=True)
    assert "without the body the proxy did not store" in (describe_problem(omitted) or "")
    rich = RichReporter(Console(file=io.StringIO()))
    rich.start(1, 0)
    rich.advance(omitted)
    rich.finish()
    plain = io.StringIO()
    reporter = PlainReporter(plain)
    reporter.start(1, 0)
    reporter.advance(omitted)
    assert "item 'a': omitted (HTTP 201" in plain.getvalue()


def test_the_live_counts_show_the_tokens_executed_not_those_replayed() -> None:
    usage = {"input_tokens": 1200, "output_tokens": 300, "total_tokens": 1500, "model": None}
    rich = RichReporter(Console(file=io.StringIO()))
    rich.start(2, 0)
    rich.advance(record("a", usage=usage))
    rich.advance(record("b", replayed=True, usage=usage))
    rich.finish()
    assert rich._progress.counts.endswith("· tokens 1,500")
    # A late answer to this batch's own unanswered try was executed and paid (SPEC §14).
    rich.advance(record("c", replayed=True, sent_before=True, usage=usage))
    assert "(replayed 1)" in rich._progress.counts
    assert rich._progress.counts.endswith("· tokens 3,000")


ADVICE = {"outcome-unknown": "never", "upstream-timeout": "never",
          "store-unavailable": "same-key", "payload-mismatch": "new-key-safe"}  # fmt: skip


@pytest.mark.parametrize(
    ("code", "job_state", "may"),
    [
        ("store-unavailable", "in_flight", True),  # SPEC §8: the outcome awaits its write
        ("store-unavailable", "none", False),  # before any claim: nothing ran
        ("shutting-down", "in_flight", True),  # a held duplicate's: its job runs
        ("shutting-down", "none", False),
        ("request-in-flight", "in_flight", True),
    ],
)
def test_a_problem_about_a_job_in_flight_leaves_the_item_in_doubt(
    code: str, job_state: str, may: bool
) -> None:
    verdict = classify(503, code, advice="same-key")
    assert verdict is Verdict.RETRY
    assert may_have_executed(503, code, verdict, job_state) is may


@pytest.mark.parametrize(
    ("body", "standing"),
    [
        (b'{"retry": "same-key", "job_state": "in_flight"}', ("same-key", "in_flight")),
        (b'{"retry": "later", "job_state": "running"}', (None, None)),
        (b'{"job_state": "none"}', (None, "none")),
        (b"[]", (None, None)),
        (b"\xff", (None, None)),
    ],
)
def test_problem_standing(body: bytes, standing: tuple[str | None, str | None]) -> None:
    assert problem_standing(body) == standing


@pytest.mark.parametrize(
    ("status", "code", "may", "settled"),
    [
        (200, None, False, True),  # the execution's answer
        (422, None, False, True),  # the execution's answer too: it says what happened
        (409, "outcome-unknown", True, False),  # SPEC §3.2: the proxy cannot know
        (504, "upstream-timeout", True, False),
        (502, None, True, False),  # a gateway of the upstream's: it may have passed it on
        (504, None, True, False),
        (503, None, False, False),  # not processed, and not the execution's answer
        (429, None, False, False),
        # Held: an execution of this very key runs (a killed run's), and will be paid.
        (409, "request-in-flight", True, False),
        (503, "too-many-waiters", True, False),
        (503, "store-unavailable", False, False),
        (409, "payload-mismatch", False, False),  # a problem of the proxy's: nothing ran
    ],
)
def test_which_answers_leave_an_item_in_doubt_and_which_settle_it(
    status: int, code: str | None, may: bool, settled: bool
) -> None:
    verdict = classify(status, code, advice=ADVICE.get(code or ""))
    assert may_have_executed(status, code, verdict) is may
    assert settles(code, verdict) is settled
    omitted = classify(201, None, replayed=True, omitted=True)
    assert not settles(None, omitted)  # SPEC §7: it executed, and nothing says what it used


class _DeadPipe(io.StringIO):
    """A log pipe whose reader went away (`| head -2`): every write after the first fails."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes > 1:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)


@pytest.mark.parametrize("gone", ["broken", "closed"])
def test_progress_lines_to_a_stream_that_is_gone_are_dropped_not_raised(gone: str) -> None:
    """The run stopped halfway with exit 1 and its items in flight abandoned."""
    stream: io.StringIO = _DeadPipe() if gone == "broken" else io.StringIO()
    reporter = PlainReporter(stream)
    reporter.start(20, 0)
    if gone == "closed":
        stream.close()
    for n in range(20):
        reporter.advance(record(f"i{n}"))  # no exception
    reporter.note("summary")
