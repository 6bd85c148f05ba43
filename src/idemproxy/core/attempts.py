"""One attempt: what its result means, and its life as a pure machine (SPEC §2.4, §3.2, §3.4, §7).

* `classify_response`, `classify_failure`, `classify_breach` and `classify_cut_off` give the
  outcome of an attempt (complete, release, unknown) for what its upstream did; `settled_state`
  the job state a failed outcome settles the job in;
* `handed_back` and `response_handling` say, by the attempt's `Mode`, whether its caller decides
  what a failed outcome does to the job, and how the response is carried on.

The machine: each state is a frozen dataclass (core/frozen.py); `state.next(event)` gives the
next one. A state that needs I/O is a command that the driver (proxy/jobs/attempt.py) carries
out before feeding back what happened:

    Forward --Head--> KeepReply | HandBack | Stream | Capture
    Forward --TransportFailed--> HandBack | Settle --> AnswerProblem (`fail`)
    Capture --BodyCaptured--> CheckContract | Complete | Settle | StreamThrough
    CheckContract --Checked--> `fail` (a breach) | as Capture without the check
    Stream, StreamThrough --BodyEnded | BodyCut--> Complete | Settle | Finish | Abort
    Complete --won--> then | Lost;  Settle --> then

`Complete` and `Settle` carry the state that follows them (`then`) and whether the response's
head went out already (`after_head`): then a store error is not the client's answer (SPEC §7,
one response per request), and a lost completion CAS changes nothing that was sent. The
terminal states (`Answer`, `Finish`, `Abort`, `AnswerProblem`, `HandBack`, `KeepReply`, `Lost`)
say what the attempt ends with. A job's attempts across its upstream group (fail-over, the
hedged race) are core/attempt_order.py's. No I/O, no clock, no asyncio here.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from typing import assert_never

from idemproxy.core.frozen import frozen
from idemproxy.core.types import JobState
from idemproxy.errors import ContractViolation, ProblemError, UpstreamTimeout, UpstreamUnavailable


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


class Mode(enum.Enum):
    """Where an attempt stands among the attempts of its job (SPEC §3.4)."""

    FINAL = "final"  # the last option: settle the job whatever happens
    FAIL_OVER = "fail-over"  # a released outcome goes to the next upstream
    HEDGED = "hedged"  # other attempts race: report failures, buffer the response


class Handling(enum.Enum):
    """How an upstream's response is carried on once its head arrived (SPEC §3.4, §7)."""

    HAND_BACK = "hand-back"  # a failure for the caller; the next upstream answers, not this body
    HAND_BACK_WITH_REPLY = "hand-back-with-reply"  # a failed racer: its answer kept for the race
    STREAM = "stream"  # a stream of events: to the client as it arrives, stored at its end
    CAPTURE = "capture"  # read up to max_stored_body (and checked against a contract), then on


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
    match failure:
        case Failure.CONNECT:
            return Outcome.RELEASE, UpstreamUnavailable
        case Failure.TIMEOUT:
            return Outcome.UNKNOWN, UpstreamTimeout
        case Failure.BROKEN:
            return Outcome.UNKNOWN, UpstreamUnavailable
        case _:
            assert_never(failure)


def classify_breach() -> tuple[Outcome, type[ProblemError]]:
    """A 2xx that breaks the route's response contract, or is too large to check against it
    (SPEC §3.4): a 2xx proves the upstream acted, so the job is unknown, never released or
    failed over (running it again would execute it twice) and never completed with a response
    the contract refuses."""
    return Outcome.UNKNOWN, ContractViolation


def classify_cut_off() -> Outcome:
    """An attempt cut off once its request may have reached the upstream: by shutdown, or by
    its response body breaking off after the head (SPEC §3.2). The upstream may have executed
    it, whatever broke."""
    return Outcome.UNKNOWN


def handed_back(outcome: Outcome, mode: Mode) -> bool:
    """Whether the caller decides what a failed outcome does to the job (SPEC §3.4): a released
    one may fail over; in a race every failure waits for the other attempts. An unknown outcome
    never fails over."""
    if outcome is Outcome.COMPLETE:
        return False
    return mode is Mode.HEDGED or (mode is Mode.FAIL_OVER and moves_on(outcome))


def response_handling(outcome: Outcome, mode: Mode, *, event_stream: bool, gated: bool) -> Handling:
    """How a response is carried on, by its outcome and the attempt's mode.

    A failure handed back in a race keeps the upstream's answer: it may be the last one the
    race gets (SPEC §3.2). A stream of events (`event_stream`) reaches its client as it arrives
    (SPEC §2 step 4), but not in a race, whose winner must be decided before a byte goes out,
    and not behind a contract gate (`gated`), which needs the whole body (SPEC §3.4)."""
    if handed_back(outcome, mode):
        return Handling.HAND_BACK_WITH_REPLY if mode is Mode.HEDGED else Handling.HAND_BACK
    if event_stream and mode is not Mode.HEDGED and not gated:
        return Handling.STREAM
    return Handling.CAPTURE


def checks_contract(outcome: Outcome) -> bool:
    """SPEC §3.4: on a route whose group has a contract, only a response that would complete
    the job is checked against it; a released or unknown one is not stored, so there is
    nothing to refuse."""
    return outcome is Outcome.COMPLETE


def completes_before_head(outcome: Outcome, mode: Mode) -> bool:
    """In a race, the attempt must win the completion CAS before a byte reaches the client
    (SPEC §7, one response per request): a body too large to keep completes the job first, as
    omitted. Elsewhere it completes once the body went out whole."""
    return mode is Mode.HEDGED and outcome is Outcome.COMPLETE


# RFC 9110 §15.5.9 408, §15.5.10 409 (Stripe and others: the first request is still being
# processed), RFC 8470 425, RFC 6585 429: none says what became of the first request.
_RESEND_IN_PROGRESS = frozenset({408, 409, 425, 429})


def resend_outcome(status: int | None) -> Outcome:
    """What the upstream's answer to a request sent again under the key it honours does to the
    job (SPEC §3.6): a final answer is the one the key stands for (executed now or before, the
    upstream's guarantee) and completes it; a timeout, a reset (`None`), an answer that the
    first one is still in progress, a refusal to take it now or a 5xx proves nothing and leaves
    it unknown, never released: an earlier attempt may have executed, whatever this one did."""
    if status is None or status in _RESEND_IN_PROGRESS or status >= 500:
        return Outcome.UNKNOWN
    return Outcome.COMPLETE


def settled_state(outcome: Outcome) -> JobState:
    """The state a failed outcome settles its job in (SPEC §3.1, §3.2)."""
    match outcome:
        case Outcome.RELEASE:
            return JobState.RELEASED
        case Outcome.UNKNOWN:
            return JobState.UNKNOWN
        case Outcome.COMPLETE:
            raise ValueError("a complete outcome completes its job, it does not settle it")
        case _:
            assert_never(outcome)


def order_mode(index: int, upstreams: int) -> Mode:
    """The mode of the attempt on the `index`-th of `upstreams` tried in order (SPEC §3.4): the
    last one settles the job, every other may fail over."""
    return Mode.FINAL if index == upstreams - 1 else Mode.FAIL_OVER


def moves_on(outcome: Outcome) -> bool:
    """Whether another attempt may start after this one (SPEC §3.4): only after an outcome that
    proves nothing executed, a release."""
    return outcome is Outcome.RELEASE


# --- the machine of one attempt -------------------------------------------------------------------


@frozen
class Failed:
    """An attempt that ended without a result to complete its job with (SPEC §3.2)."""

    outcome: Outcome
    status: int | None
    error: str | None
    problem: type[ProblemError] = UpstreamUnavailable


class Body(enum.Enum):
    """What a completion stores of the response's body (SPEC §7)."""

    KEPT = "kept"  # the body as captured (or teed), if it was whole
    OMITTED = "omitted"  # over max_stored_body: stored without it


# --- events -------------------------------------------------------------------------------------


@frozen
class Head:
    """The upstream's response head arrived."""

    status: int
    event_stream: bool  # a stream of events (server-sent events, NDJSON)


@frozen
class TransportFailed:
    """No response head: refused, timed out, reset (SPEC §3.2)."""

    failure: Failure
    reason: str


@frozen
class BodyCaptured:
    """The body was read up to max_stored_body: `whole` if all of it fit."""

    whole: bool


@frozen
class Checked:
    """The captured response was checked against the route's contract (SPEC §3.4)."""

    violations: tuple[str, ...]


@frozen
class BodyEnded:
    """The rest of the body reached the client whole."""


@frozen
class BodyCut:
    """The upstream's body broke off after the head went to the client (SPEC §3.2)."""

    reason: str


# --- terminal states ----------------------------------------------------------------------------


@frozen
class Answer:
    """Send the captured response to the client as a whole."""


@frozen
class Finish:
    """End the response already streaming to the client."""


@frozen
class Abort:
    """Cut the client's connection: its response started and cannot end well (SPEC §7)."""


@frozen
class AnswerProblem:
    """The job is settled: answer with the problem of `failed` (SPEC §3.2)."""

    failed: Failed


@frozen
class HandBack:
    """The caller decides what the failure does to the job (SPEC §3.4); the body is not needed."""

    failed: Failed


@frozen
class KeepReply:
    """Hand back in a race, with the upstream's answer kept: it may be the last one the race
    gets (SPEC §3.2)."""

    failed: Failed


@frozen
class Lost:
    """Another attempt won the completion CAS: this result is discarded (SPEC §1)."""


# --- command states -----------------------------------------------------------------------------


@frozen
class Complete:
    """Command: the completion CAS with the response, its body `body`."""

    body: Body
    after_head: bool
    then: AttemptState

    def next(self, won: bool | None) -> AttemptState:
        """`won` is None when the store could not be reached after the head went out: the
        outcome is kept to write later, and the response is on its way whatever the CAS says
        (SPEC §7)."""
        return self.then if won or self.after_head else Lost()


@frozen
class Settle:
    """Command: settle the job as `failed` says (SPEC §3.2); a lost CAS is only logged."""

    failed: Failed
    after_head: bool
    then: AttemptState

    def next(self) -> AttemptState:
        return self.then


def fail(failed: Failed, mode: Mode) -> HandBack | Settle:
    """No response to pass on: hand it back, or settle the job and answer its problem."""
    if handed_back(failed.outcome, mode):
        return HandBack(failed)
    return Settle(failed, after_head=False, then=AnswerProblem(failed))


@frozen
class Forward:
    """Command: send the request upstream; wait for the head of its response."""

    mode: Mode
    gated: bool  # the route's group has a response contract (SPEC §3.4)
    statuses: StatusPolicy
    # SPEC §3.6: the request sent again under the key its upstream honours, after an attempt
    # whose outcome is unknown: `resend_outcome` overrides the statuses' classification.
    resend: bool = False

    def next(self, event: Head | TransportFailed) -> AttemptState:
        if isinstance(event, TransportFailed):
            outcome, problem = classify_failure(event.failure)
            if self.resend:
                outcome = resend_outcome(None)
            return fail(Failed(outcome, None, event.reason, problem), self.mode)
        if self.resend:
            outcome = resend_outcome(event.status)
        else:
            outcome = classify_response(event.status, self.statuses)
        handling = response_handling(
            outcome, self.mode, event_stream=event.event_stream, gated=self.gated
        )
        if handling is Handling.CAPTURE:
            check = self.gated and checks_contract(outcome)
            return Capture(outcome, event.status, self.mode, check)
        if handling is Handling.STREAM:
            return Stream(outcome, event.status)
        failed = Failed(outcome, event.status, None)
        return KeepReply(failed) if handling is Handling.HAND_BACK_WITH_REPLY else HandBack(failed)


@frozen
class Capture:
    """Command: read the body up to max_stored_body (SPEC §7)."""

    outcome: Outcome
    status: int
    mode: Mode
    check: bool  # against the route's contract, before anything is stored or sent

    def next(self, event: BodyCaptured) -> AttemptState:
        if self.check:
            return CheckContract(self.outcome, self.status, self.mode, event.whole)
        return _captured(self.outcome, self.status, self.mode, event.whole)


@frozen
class CheckContract:
    """Command: check the captured response against the route's contract (SPEC §3.4)."""

    outcome: Outcome
    status: int
    mode: Mode
    whole: bool

    def next(self, event: Checked) -> AttemptState:
        if event.violations:
            # The upstream acted: unknown, never released (SPEC §3.4).
            outcome, problem = classify_breach()
            error = "contract: " + "; ".join(event.violations)
            return fail(Failed(outcome, self.status, error, problem), self.mode)
        return _captured(self.outcome, self.status, self.mode, self.whole)


def _captured(outcome: Outcome, status: int, mode: Mode, whole: bool) -> AttemptState:
    """After the capture: the outcome is stored before the client sees a byte of a whole body,
    so that a client that retries after a lost response always finds it; a larger one streams
    through (SPEC §7), in a race only once it won the CAS."""
    if whole:
        if outcome is Outcome.COMPLETE:
            return Complete(Body.KEPT, after_head=False, then=Answer())
        return Settle(Failed(outcome, status, None), after_head=False, then=Answer())
    if completes_before_head(outcome, mode):
        return Complete(Body.OMITTED, after_head=False, then=StreamThrough(outcome, status, True))
    return StreamThrough(outcome, status, completed=False)


@frozen
class StreamThrough:
    """Command: pass the rest of a body too large to keep to the client (SPEC §7)."""

    outcome: Outcome
    status: int
    completed: bool  # in a race, it completed the job before its head went out

    def next(self, event: BodyEnded | BodyCut) -> AttemptState:
        if isinstance(event, BodyCut):
            if self.completed:
                return Abort()  # the job is completed; what broke off is the client's loss
            cut = Failed(classify_cut_off(), self.status, event.reason)
            return Settle(cut, after_head=True, then=Abort())
        if self.outcome is not Outcome.COMPLETE:
            return Settle(Failed(self.outcome, self.status, None), after_head=True, then=Finish())
        if self.completed:
            return Finish()
        return Complete(Body.OMITTED, after_head=True, then=Finish())


@frozen
class Stream:
    """Command: a stream of events to the client as it arrives, kept up to max_stored_body, and
    stored once it ended (SPEC §2 step 4)."""

    outcome: Outcome
    status: int

    def next(self, event: BodyEnded | BodyCut) -> AttemptState:
        if isinstance(event, BodyCut):
            cut = Failed(classify_cut_off(), self.status, event.reason)
            return Settle(cut, after_head=True, then=Abort())
        if self.outcome is Outcome.COMPLETE:
            return Complete(Body.KEPT, after_head=True, then=Finish())
        return Settle(Failed(self.outcome, self.status, None), after_head=True, then=Finish())


def cut_off(reason: str) -> Failed:
    """An attempt cut off by shutdown: its request may have reached the upstream (SPEC §3.2)."""
    return Failed(classify_cut_off(), None, reason)


AttemptState = (
    Forward
    | Capture
    | CheckContract
    | Stream
    | StreamThrough
    | Complete
    | Settle
    | Answer
    | Finish
    | Abort
    | AnswerProblem
    | HandBack
    | KeepReply
    | Lost
)
