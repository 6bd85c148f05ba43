"""One record per request: its outcome for the metrics and its log line (SPEC §13).

The log line carries the job id, the attempt number, a prefix of the owner hash and the
outcome; never a body, a key's credential or a header value.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from idemproxy.errors import (
    BodyTooLarge,
    ClientDisconnected,
    HeaderInvalid,
    KeyInvalid,
    KeyMissing,
    NoRoute,
    OutcomeUnknown,
    OwnerMissing,
    PathInvalid,
    PayloadMismatch,
    ProblemError,
    RequestInFlight,
    RequestTimeout,
    ShuttingDown,
    StoreUnavailable,
    TooManyWaiters,
)
from idemproxy.metrics import Metrics, RequestOutcome

log = logging.getLogger("idemproxy.requests")
# Read on every request, so bound once: a member read off its enum class costs CPython 3.11
# about 800 instructions (the enum metaclass's __getattr__ slows every class attribute read).
_NEW, _HELD, _REPLAYED = RequestOutcome.NEW, RequestOutcome.HELD, RequestOutcome.REPLAYED
_PASSTHROUGH, _REJECTED = RequestOutcome.PASSTHROUGH, RequestOutcome.REJECTED
_OWNER_PREFIX = 8
_PROBLEM_OUTCOMES: dict[type[ProblemError], RequestOutcome] = {
    PayloadMismatch: RequestOutcome.MISMATCH,
    RequestInFlight: RequestOutcome.IN_FLIGHT_CONFLICT,
    OutcomeUnknown: RequestOutcome.UNKNOWN,
    StoreUnavailable: RequestOutcome.UNAVAILABLE,
    TooManyWaiters: RequestOutcome.UNAVAILABLE,
    ShuttingDown: RequestOutcome.UNAVAILABLE,
    KeyInvalid: RequestOutcome.REJECTED,
    HeaderInvalid: RequestOutcome.REJECTED,
    PathInvalid: RequestOutcome.REJECTED,
    KeyMissing: RequestOutcome.REJECTED,
    OwnerMissing: RequestOutcome.REJECTED,
    BodyTooLarge: RequestOutcome.REJECTED,
    RequestTimeout: RequestOutcome.REJECTED,
    ClientDisconnected: RequestOutcome.REJECTED,
    NoRoute: RequestOutcome.REJECTED,
}


@dataclass(slots=True)
class Trace:
    outcome: RequestOutcome = _PASSTHROUGH
    owner: str | None = None
    job_id: str | None = None
    attempt: int | None = None
    held: bool = False
    started: float = field(default_factory=time.perf_counter)

    def ran(self, job_id: str, attempt: int) -> None:
        self.outcome, self.job_id, self.attempt = _NEW, job_id, attempt

    def replayed(self, job_id: str) -> None:
        self.job_id = job_id
        if self.outcome != _NEW:  # a request whose own attempt lost the CAS still ran
            self.outcome = _HELD if self.held else _REPLAYED

    def problem(self, error: ProblemError) -> None:
        if self.outcome != _NEW:
            self.outcome = _PROBLEM_OUTCOMES.get(type(error), _REJECTED)


def record(metrics: Metrics, trace: Trace, status: int, *, log_requests: bool) -> None:
    metrics.request_outcome[trace.outcome].inc()
    if not log_requests or trace.outcome == _PASSTHROUGH or not log.isEnabledFor(logging.INFO):
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
    if logging.getLogRecordFactory() is logging.LogRecord:
        log.handle(_RequestRecord(_Line(fields), fields))
    else:  # a factory of someone else's (OpenTelemetry's, say) must see every record
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


class _RequestRecord(logging.LogRecord):
    """The record `log.makeRecord` would make for `record`'s line, with what is the same for
    every request (logger, level, file, module, function) worked out once rather than per line:
    `LogRecord.__init__` takes the file's base name and extension apart on every call (12,700
    of the line's 76,000 instructions, bench/compare)."""

    def __init__(self, message: _Line, fields: dict[str, object]) -> None:
        # LogRecord.__init__ is not called: every attribute it sets is set here.
        now = time.time()
        self.__dict__.update(_CONSTANT)
        self.msg = message
        self.fields = fields
        self.created = now
        self.msecs = int((now - int(now)) * 1000) + 0.0  # as LogRecord does (gh-89047)
        self.relativeCreated = (now - _START) * 1000
        if logging.logThreads:
            self.thread, self.threadName = threading.get_ident(), threading.current_thread().name
        if logging.logMultiprocessing:
            self.processName = "MainProcess"
        if logging.logProcesses:
            self.process = os.getpid()


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
_START: float = getattr(logging, "_startTime", time.time())  # relativeCreated's origin
# What LogRecord.__init__ would set for `record`'s line that does not change between lines.
_CONSTANT: dict[str, object] = {
    "name": log.name,
    "args": (),
    "levelname": logging.getLevelName(logging.INFO),
    "levelno": logging.INFO,
    "pathname": __file__,
    "filename": os.path.basename(__file__),
    "module": os.path.splitext(os.path.basename(__file__))[0],
    "exc_info": None,
    "exc_text": None,
    "stack_info": None,
    "lineno": _LINE,
    "funcName": "record",
    "thread": None,
    "threadName": None,
    "processName": None,
    "process": None,
    "taskName": None,  # Python 3.12's, for formatters written for it
}
