"""One record per request: its outcome and duration for the metrics and its log line (SPEC §13).

The log line carries the method, the path (its query string only when `log_query` is set, and
then with secret-looking values masked), the route's prefix, the upstream's origin, the job id,
the attempt number, a prefix of the owner hash, the outcome and, for a failure, a `reason` of a
closed set (proxy/reasons.py); never a body, a key's credential or a header value. The field
names are stable: docs/operations.md, Logs, lists them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from idemproxy.constants import ANONYMOUS_OWNER, WEBHOOK_OWNER_PREFIX
from idemproxy.errors import (
    BodyTooLarge,
    ClientDisconnected,
    HeaderInvalid,
    IdentityUnavailable,
    KeyInvalid,
    KeyMissing,
    KeyNotFound,
    NoRoute,
    OutcomeUnknown,
    OwnerMissing,
    OwnerUnstable,
    PathInvalid,
    PayloadMismatch,
    ProblemError,
    QuotaExceeded,
    RequestInFlight,
    RequestTimeout,
    ResponseUnreadable,
    ShuttingDown,
    StoreUnavailable,
    TooManyWaiters,
)
from idemproxy.observe.metrics import STATUS_CLASSES, UNROUTED, Metrics, RequestOutcome, Source
from idemproxy.proxy.reasons import FailureReason
from idemproxy.proxy.routing import upstream_origin
from idemproxy.redact import redact_path, redact_query

if TYPE_CHECKING:
    from aiohttp import web

    from idemproxy.proxy.routing import Route

log = logging.getLogger("idemproxy.requests")
# Read on every request, so bound once: a member read off its enum class costs CPython 3.11
# about 800 instructions (the enum metaclass's __getattr__ slows every class attribute read).
_NEW, _HELD, _REPLAYED = RequestOutcome.NEW, RequestOutcome.HELD, RequestOutcome.REPLAYED
_PASSTHROUGH, _REJECTED = RequestOutcome.PASSTHROUGH, RequestOutcome.REJECTED
_OWNER_PREFIX = 8
_STORE = FailureReason.STORE
_PROXY, _UPSTREAM = Source.PROXY, Source.UPSTREAM
_STATUS_LOOKUP = RequestOutcome.STATUS_LOOKUP
# A reason is logged with an answer that reports a failure: a failed attempt that a fallback
# made good is no failure of the request.
_FAILED_STATUS = 500
_PROBLEM_OUTCOMES: dict[type[ProblemError], RequestOutcome] = {
    PayloadMismatch: RequestOutcome.MISMATCH,
    RequestInFlight: RequestOutcome.IN_FLIGHT_CONFLICT,
    OutcomeUnknown: RequestOutcome.UNKNOWN,
    StoreUnavailable: RequestOutcome.UNAVAILABLE,
    TooManyWaiters: RequestOutcome.UNAVAILABLE,
    QuotaExceeded: RequestOutcome.REJECTED,
    ShuttingDown: RequestOutcome.UNAVAILABLE,
    IdentityUnavailable: RequestOutcome.UNAVAILABLE,
    # The job completed, but its stored response cannot be opened (SPEC §11): the proxy's
    # failure to answer, not the client's request refused.
    ResponseUnreadable: RequestOutcome.UNAVAILABLE,
    KeyInvalid: RequestOutcome.REJECTED,
    HeaderInvalid: RequestOutcome.REJECTED,
    PathInvalid: RequestOutcome.REJECTED,
    KeyMissing: RequestOutcome.REJECTED,
    OwnerMissing: RequestOutcome.REJECTED,
    OwnerUnstable: RequestOutcome.REJECTED,
    BodyTooLarge: RequestOutcome.REJECTED,
    RequestTimeout: RequestOutcome.REJECTED,
    ClientDisconnected: RequestOutcome.REJECTED,
    NoRoute: RequestOutcome.REJECTED,
    KeyNotFound: RequestOutcome.STATUS_LOOKUP,
}


@dataclass(slots=True)
class Trace:
    outcome: RequestOutcome = _PASSTHROUGH
    owner: str | None = None
    job_id: str | None = None
    attempt: int | None = None
    held: bool = False
    started: float = field(default_factory=time.perf_counter)
    request: web.BaseRequest | None = None
    route: Route | None = None
    upstream: str | None = None  # the configured URL of the last upstream called
    # The number of the attempt sent to `upstream` (a fail-over's later one): the log line's
    # `attempt`; `attempt` stays the one the request claimed (its span's, proxy/tracing.py).
    forwarded: int | None = None
    reason: FailureReason | None = None
    # The answer is the proxy's own (it carries `Idempotency-Error`, SPEC §8), not the upstream's.
    by_proxy: bool = False

    def failed(self, upstream: str, reason: FailureReason) -> None:
        self.upstream, self.reason = upstream, reason

    def replayed(self, job_id: str) -> None:
        self.job_id = job_id
        if self.outcome != _NEW:  # a request whose own attempt lost the CAS still ran
            self.outcome = _HELD if self.held else _REPLAYED

    def problem(self, error: ProblemError) -> None:
        if isinstance(error, StoreUnavailable):
            self.reason = _STORE
        if self.outcome != _NEW:
            self.outcome = _PROBLEM_OUTCOMES.get(type(error), _REJECTED)


def record(
    metrics: Metrics,
    trace: Trace,
    status: int,
    log_requests: bool,
    access_log: bool = False,
    log_query: bool = False,
) -> None:
    """Count the request, observe its duration and log its line: `log_requests` for governed
    requests, `access_log` for pass-through ones. Positional as well: the handler hands it to
    the event loop's `call_soon`, which takes no keywords."""
    elapsed = time.perf_counter() - trace.started
    outcome = trace.outcome
    source = _PROXY if trace.by_proxy or outcome == _STATUS_LOOKUP else _UPSTREAM
    # `2xx` for 201 (RFC 9110 §15); a status outside 100-599 counts in the nearest class.
    status_class = STATUS_CLASSES[min(max(status // 100, 1), 5) - 1]
    key = (outcome, status_class, source)
    metrics.request_answer[key].add(1)
    route = trace.route
    metrics.request_route[UNROUTED if route is None else route.prefix][key].observe(elapsed)
    if not (access_log if outcome == _PASSTHROUGH else log_requests):
        return
    if not log.isEnabledFor(logging.INFO):
        return
    kind = "passthrough" if outcome == _PASSTHROUGH else "governed"
    # What `log.info` does, minus its walk up the stack for the caller: it is always this
    # function.
    line = _RequestRecord(kind, _fields(trace, status, elapsed, log_query))
    if logging.getLogRecordFactory() is logging.LogRecord:
        log.handle(line)
    else:  # a factory of someone else's (OpenTelemetry's, say) must see every record
        log.handle(
            log.makeRecord(
                log.name,
                logging.INFO,
                __file__,
                _LINE,
                line.msg,
                (),
                None,
                "record",
                {"fields": line.fields},
            )
        )


def _fields(trace: Trace, status: int, elapsed: float, log_query: bool) -> dict[str, object]:
    request, route, owner = trace.request, trace.route, trace.owner
    upstream = trace.upstream
    if upstream is None and route is not None and trace.outcome == _PASSTHROUGH:
        upstream = route.upstream
    path = None
    if request is not None:
        url = request.rel_url
        path, query = url.raw_path, url.raw_query_string
        # A session id in it is a credential: the marks `redact_path` looks for, tested here
        # so that a path without any (nearly every one) costs no call.
        if ";" in path or "(" in path or "%" in path:
            path = redact_path(path)
        if log_query and query:
            path = f"{path}?{redact_query(query)}"
    # SPEC §5: a prefix of the owner hash, enough to correlate, not enough to identify. A
    # webhook sender's scope is a configured name, not a credential: shown whole (SPEC §4.2).
    if owner and owner != ANONYMOUS_OWNER and not owner.startswith(WEBHOOK_OWNER_PREFIX):
        owner = owner[:_OWNER_PREFIX]
    return {
        "outcome": trace.outcome,
        "status": status,
        "method": None if request is None else request.method,
        "path": path,
        "route": None if route is None else route.prefix,
        "upstream": None if upstream is None else upstream_origin(upstream),
        "job": trace.job_id,
        "attempt": trace.attempt if trace.forwarded is None else trace.forwarded,
        "owner": owner or None,
        "ms": round(elapsed * 1000, 2),
        "reason": trace.reason if status >= _FAILED_STATUS else None,
    }


class _RequestRecord(logging.LogRecord):
    """The record `log.makeRecord` would make for `record`'s line, with what is the same for
    every request (logger, level, file, module, function) worked out once rather than per line:
    `LogRecord.__init__` takes the file's base name and extension apart on every call (12,700
    of the line's 76,000 instructions, bench/compare). Its message is the plain line,
    `governed outcome=new status=201 …` (docs/operations.md, Logs), joined once here for
    every handler's formatter."""

    def __init__(self, kind: str, fields: dict[str, object]) -> None:
        # LogRecord.__init__ is not called: every attribute it sets is set here.
        now = time.time()
        self.__dict__.update(_CONSTANT)
        # A loop rather than a comprehension: on Python 3.11 that is a call of its own.
        pairs = [kind]
        for name, value in fields.items():
            if value is not None:
                pairs.append(f"{name}={value}")
        self.msg = " ".join(pairs)
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
