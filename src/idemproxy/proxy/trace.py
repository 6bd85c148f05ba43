"""One record per request: its outcome for the metrics and its log line (SPEC §13).

The log line carries the job id, the attempt number, a prefix of the owner hash and the
outcome; never a body, a key's credential or a header value.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from idemproxy.errors import (
    BodyTooLarge,
    HeaderInvalid,
    KeyInvalid,
    KeyMissing,
    NoRoute,
    OutcomeUnknown,
    OwnerMissing,
    PayloadMismatch,
    ProblemError,
    RequestInFlight,
    RequestTimeout,
    StoreUnavailable,
    TooManyWaiters,
)
from idemproxy.metrics import Metrics

log = logging.getLogger("idemproxy.requests")
_OWNER_PREFIX = 8
_PROBLEM_OUTCOMES: dict[type[ProblemError], str] = {
    PayloadMismatch: "mismatch",
    RequestInFlight: "in_flight_conflict",
    OutcomeUnknown: "unknown",
    StoreUnavailable: "unavailable",
    TooManyWaiters: "unavailable",
    KeyInvalid: "rejected",
    HeaderInvalid: "rejected",
    KeyMissing: "rejected",
    OwnerMissing: "rejected",
    BodyTooLarge: "rejected",
    RequestTimeout: "rejected",
    NoRoute: "rejected",
}


@dataclass(slots=True)
class Trace:
    outcome: str = "passthrough"
    owner: str | None = None
    job_id: str | None = None
    attempt: int | None = None
    held: bool = False
    started: float = field(default_factory=time.perf_counter)

    def ran(self, job_id: str, attempt: int) -> None:
        self.outcome, self.job_id, self.attempt = "new", job_id, attempt

    def replayed(self, job_id: str) -> None:
        self.job_id = job_id
        if self.outcome != "new":  # a request whose own attempt lost the CAS still ran
            self.outcome = "held" if self.held else "replayed"

    def problem(self, error: ProblemError) -> None:
        if self.outcome != "new":
            self.outcome = _PROBLEM_OUTCOMES.get(type(error), "rejected")


def record(metrics: Metrics, trace: Trace, status: int, *, log_requests: bool) -> None:
    metrics.request_outcome[trace.outcome].inc()
    if not log_requests or trace.outcome == "passthrough" or not log.isEnabledFor(logging.INFO):
        return
    fields = {
        "outcome": trace.outcome,
        "status": status,
        "job": trace.job_id,
        "attempt": trace.attempt,
        "owner": trace.owner[:_OWNER_PREFIX] if trace.owner else None,
        "ms": round((time.perf_counter() - trace.started) * 1000, 2),
    }
    # What `log.info` does, minus its walk up the stack for the caller: it is always this
    # function. The message is joined when a handler formats it, once, not here.
    log.handle(
        log.makeRecord(
            log.name,
            logging.INFO,
            __file__,
            _LINE,
            _Line(fields),
            (),
            None,
            "record",
            {"fields": fields},
        )
    )


class _Line:
    """The plain message, `governed outcome=new status=201 …` (docs/operations.md, Logs)."""

    __slots__ = ("_fields", "_text")

    def __init__(self, fields: dict[str, object]) -> None:
        self._fields = fields
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:  # every handler's formatter asks for it
            pairs = [f"{name}={value}" for name, value in self._fields.items() if value is not None]
            self._text = "governed " + " ".join(pairs)
        return self._text


# The records' line number: `record`'s own (its name and file are given with it).
_LINE = record.__code__.co_firstlineno
