"""One attempt's life as a pure machine: which step follows which (SPEC §2.4, §3.2, §3.4, §7).

Each state is a frozen dataclass (core/frozen.py); `state.next(event)` gives the next one. A
state that needs I/O is a command that the driver (proxy/jobs/attempt.py) carries out before
feeding back what happened:

    Forward --Head--> KeepReply | HandBack | Stream | Capture
    Forward --TransportFailed--> HandBack | Settle --> AnswerProblem (`fail`)
    Capture --BodyCaptured--> CheckContract | Complete | Settle | StreamThrough
    CheckContract --Checked--> `fail` (a breach) | as Capture without the check
    Stream, StreamThrough --BodyEnded | BodyCut--> Complete | Settle | Finish | Abort
    Complete --won--> then | Lost;  Settle --> then

`Complete` and `Settle` carry the state that follows them (`then`) and whether the response's
head went out already (`after_head`): then a store error is not the client's answer (SPEC §7,
one response per request), and a lost completion CAS changes nothing that was sent.
The terminal states (`Answer`, `Finish`, `Abort`, `AnswerProblem`, `HandBack`, `KeepReply`,
`Lost`) say what the attempt ends with. No I/O, no clock, no asyncio here.
"""

from __future__ import annotations

import enum

from idemproxy.core.attempts import (
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
    response_handling,
)
from idemproxy.core.frozen import frozen
from idemproxy.errors import ProblemError, UpstreamUnavailable


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

    def next(self, event: Head | TransportFailed) -> AttemptState:
        if isinstance(event, TransportFailed):
            outcome, problem = classify_failure(event.failure)
            return fail(Failed(outcome, None, event.reason, problem), self.mode)
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
