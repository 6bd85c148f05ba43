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
    metrics.requests.labels(trace.outcome).inc()
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
    log.info(
        "governed %s",
        " ".join(f"{k}={v}" for k, v in fields.items() if v is not None),
        extra={"fields": fields},
    )
