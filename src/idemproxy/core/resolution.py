"""How an `unknown` job may resolve itself: pure code over plain data, no I/O, no clock
(SPEC §3.6).

* `read_reconcile_answer` says what a reconcile endpoint's answer proves about the attempt it
  was asked about: executed (with its response), never executed, or nothing;
* `asked_attempts` says which attempts are asked about, `releasable` whether the answers
  "never executed" release the job;
* `Backoff` says when the next question is due;
* `may_resend` says whether a retry of an `unknown` job may go upstream again under the key
  the upstream honours; `read_resend_answer` what that upstream's answer proves.

Every "no" keeps the job `unknown`: one execution per intent is kept by never guessing.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from idemproxy.core.machine import Outcome, resend_outcome
from idemproxy.core.types import Attempt, AttemptState, HeaderPairs, Job, JobState, StoredResponse


class Way(enum.StrEnum):
    """How an `unknown` job was asked about (evidence, metrics)."""

    RECONCILE = "reconcile"  # the backend's reconcile endpoint
    UPSTREAM_KEY = "upstream_key"  # the request sent again under the key the upstream honours


class Verdict(enum.StrEnum):
    """What an answer proves about the attempt asked about."""

    EXECUTED = "executed"
    NOT_EXECUTED = "not_executed"
    UNKNOWN = "unknown"  # proves nothing: the job stays `unknown`


@dataclass(frozen=True, slots=True)
class Question:
    """What the proxy asks a reconcile endpoint: about attempt `attempt` of job `job_id`."""

    job_id: str
    key: str
    attempt: int
    method: str
    path: str

    def as_json(self) -> dict[str, Any]:
        return {
            "job": self.job_id,
            "key": self.key,
            "attempt": self.attempt,
            "method": self.method,
            "path": self.path,
        }


@dataclass(frozen=True, slots=True)
class Reading:
    """An answer, read: its verdict, the response an executed attempt gave, and why."""

    verdict: Verdict
    reason: str
    response: StoredResponse | None = None


def _unknown(reason: str) -> Reading:
    return Reading(Verdict.UNKNOWN, reason)


def read_reconcile_answer(question: Question, status: int | None, body: bytes | None) -> Reading:
    """A reconcile endpoint's answer (`status` None: none came, a timeout or a reset). Only a
    200 whose JSON names this very job and attempt, and says `executed` true (with the
    response it gave) or false, proves anything."""
    if status is None:
        return _unknown("no answer")
    if status != 200:
        return _unknown(f"status {status}")
    try:
        data = json.loads(body or b"", object_pairs_hook=_unique_members, parse_constant=_refuse)
    except (ValueError, UnicodeDecodeError):
        return _unknown("not JSON, or a member named twice in an object")
    if not isinstance(data, dict):
        return _unknown("not a JSON object")
    # The attempt as a JSON integer: `true` and `1.0` equal 1 in Python, and name no attempt.
    attempt = data.get("attempt")
    if (
        data.get("job") != question.job_id
        or type(attempt) is not int
        or attempt != question.attempt
    ):
        return _unknown("an answer about another job or attempt")
    executed = data.get("executed")
    if executed is False:
        return Reading(Verdict.NOT_EXECUTED, "never executed")
    if executed is not True:
        return _unknown("executed is neither true nor false")
    return _executed(data.get("response"))


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object, refused when it names a member twice: RFC 8259 §4 leaves which one counts to
    the parser, and `{"executed": true, "executed": false}` must prove nothing, not whatever
    the last one says (a job released on it ran again)."""
    members = dict(pairs)
    if len(members) != len(pairs):
        raise ValueError("a member name occurs twice")
    return members


def _refuse(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")  # RFC 8259 §6: no NaN or Infinity


def _executed(data: Any) -> Reading:
    if not isinstance(data, dict):
        return _unknown("executed, without a response")
    status = data.get("status")
    # A replay sends a final status (RFC 9110 §15: 1xx are interim); bool is an int in Python.
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        return _unknown("executed, with a status that is not a final one")
    headers = _headers(data.get("headers", []))
    body = _body(data)
    if headers is None or body is None:
        return _unknown("executed, with malformed headers or body")
    return Reading(Verdict.EXECUTED, "executed", StoredResponse(status, headers, body))


def _headers(data: Any) -> HeaderPairs | None:
    if not isinstance(data, list):
        return None
    pairs = []
    for pair in data:
        if not (
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)
        ):
            return None
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


def _body(data: dict[str, Any]) -> bytes | None:
    text, coded = data.get("body"), data.get("body_base64")
    if text is not None and coded is not None:
        return None
    if isinstance(coded, str):
        try:
            return base64.b64decode(coded, validate=True)
        except binascii.Error:
            return None
    if coded is not None:
        return None
    if text is None:
        return b""
    return text.encode() if isinstance(text, str) else None


def asked_attempts(job: Job) -> tuple[Attempt, ...]:
    """The attempts questions are about: every one of the job's whose outcome is unknown (any
    of them may have executed; a resend the upstream answered "in progress" is one too, and the
    backend truthfully says "never executed" about it while the first did execute), and every
    one whose answer came after the job had become `unknown` (a taken-over attempt, SPEC §3.5:
    its result lost the CAS and is kept for the operator), which did reach its upstream."""
    return tuple(a for a in job.attempts if a.state in _ASKED)


_ASKED = frozenset({AttemptState.UNKNOWN, AttemptState.DISCARDED})


def never_executed(job: Job) -> frozenset[int]:
    """The attempts of `job` a reconcile endpoint answered "never executed" about: final, as a
    backend says so only once it is sure it never will (SPEC §3.6)."""
    return frozenset(
        a.number
        for a in job.attempts
        if any(
            e.way == Way.RECONCILE.value and e.verdict == Verdict.NOT_EXECUTED.value
            for e in a.evidence
        )
    )


def releasable(job: Job, never: frozenset[int]) -> bool:
    """SPEC §3.6: "never executed" releases the job only once every attempt of it that may have
    executed was answered so (`never`, the attempts answered "never executed"), each other one
    having failed, proving nothing reached its upstream. An attempt whose upstream answered it
    (`discarded`: its answer came too late to count) is never released by such an answer."""
    return job.state is JobState.UNKNOWN and all(
        a.state is AttemptState.FAILED or (a.state is AttemptState.UNKNOWN and a.number in never)
        for a in job.attempts
    )


@dataclass(frozen=True, slots=True)
class Backoff:
    """When questions about an attempt are due: `first` seconds after it ended, then each time
    the time a question may take (`answer_within`, the endpoint's timeout) plus a wait that
    doubles from `first` up to `longest`, so that two questions never overlap, whichever
    replica asks them."""

    first: float
    longest: float
    answer_within: float

    def due_after(self, checks: int) -> float:
        """Seconds after the last of `checks` questions (or the attempt's end, for the first)."""
        if checks == 0:
            return self.first
        return self.answer_within + min(self.first * float(2 ** min(checks, 32)), self.longest)


class Resend(enum.StrEnum):
    """Whether a retry of an `unknown` job may go upstream again under the key (SPEC §3.6)."""

    ALLOWED = "allowed"
    NOT_DECLARED = "not_declared"  # the route does not declare that its upstream honours keys
    NOT_UNKNOWN = "not_unknown"
    NO_ATTEMPT = "no_attempt"  # no attempt of it may have executed
    WINDOW_PASSED = "window_passed"
    DIFFERENT_REQUEST = "different_request"
    DIFFERENT_UPSTREAM = "different_upstream"


@dataclass(frozen=True, slots=True)
class ResendAsk:
    """A retry of an `unknown` job, as the rule needs it: `sent`, the digest of the request
    as it would go upstream (method, target, body bytes); `upstream`, where it would go."""

    fingerprint: str
    sent: str
    upstream: str
    now: datetime


def first_sent(job: Job) -> Attempt | None:
    """The first attempt of the job that may have reached its upstream (any but a failed one,
    SPEC §3.2): the upstream's window for the key counts from its start."""
    return next((a for a in job.attempts if a.state is not AttemptState.FAILED), None)


def may_resend(job: Job, ask: ResendAsk, *, window: float | None) -> Resend:
    """SPEC §3.6: only on a route that declares its upstream honours the key (`window`), within
    that window counted from the first attempt that may have reached it, for the very request
    every such attempt sent (their `sent_digest`: the fingerprint alone ignores excluded JSON
    members and key order), to the very upstream they all went to (hedged attempts on another
    upstream may have executed there, under a key that upstream never connects to this one)."""
    if window is None:
        return Resend.NOT_DECLARED
    if job.state is not JobState.UNKNOWN:
        return Resend.NOT_UNKNOWN
    first = first_sent(job)
    if first is None:
        return Resend.NO_ATTEMPT
    if first.started_at is None or ask.now >= first.started_at + timedelta(seconds=window):
        return Resend.WINDOW_PASSED
    sent = [a for a in job.attempts if a.state is not AttemptState.FAILED]
    if ask.fingerprint != job.fingerprint or any(a.sent_digest != ask.sent for a in sent):
        return Resend.DIFFERENT_REQUEST
    if any(a.upstream != ask.upstream for a in sent):
        return Resend.DIFFERENT_UPSTREAM
    return Resend.ALLOWED


def read_resend_answer(status: int | None) -> Verdict:
    """The upstream's answer to the request sent again under its key, as evidence: what
    core/machine.py `resend_outcome` makes of it."""
    executed = resend_outcome(status) is Outcome.COMPLETE
    return Verdict.EXECUTED if executed else Verdict.UNKNOWN
