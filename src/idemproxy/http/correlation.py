"""What joins one request's log lines, problem documents, upstream call and trace: its request
id (the client's `X-Request-Id`, or one made up) and, with tracing on, its trace and span ids
(docs/operations.md, Logs).

A context variable: set by the request's handler for its whole life and inherited by the tasks
it starts (an attempt runs in its own task, SPEC §2), read by every log line's formatter.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass, replace

from idemproxy.randomness import RANDOM_128, refill

# A client's id is taken as it is when it is one value of 1-200 visible ASCII characters (what
# nginx's $request_id, Heroku's and the AWS load balancers' ids are); else one is made up.
_ACCEPTED = re.compile(r"[\x21-\x7e]{1,200}")


@dataclass(frozen=True, slots=True)
class Correlation:
    request_id: str
    header: str  # the request id header's name (`request_id_header`)
    # Made up here: it goes upstream too. A client's own id goes upstream as the client sent
    # it, with the rest of its headers.
    made: bool = False
    trace_id: str | None = None  # 32 hex digits (W3C Trace Context), with tracing on
    span_id: str | None = None  # 16 hex digits: the request's server span

    def fields(self) -> dict[str, str]:
        """The ids as log fields, those that are set."""
        found = {"request_id": self.request_id}
        if self.trace_id is not None and self.span_id is not None:
            found["trace_id"], found["span_id"] = self.trace_id, self.span_id
        return found


CURRENT: ContextVar[Correlation | None] = ContextVar("idemproxy_correlation", default=None)


def correlation_of(header: str, values: list[str]) -> Correlation:
    """The request's correlation from the values of its request id header: the client's one
    valid id, else a new one (a UUID). A new one goes upstream only when the client sent none:
    what a client did send reaches the backend as it was sent (a route may key on that very
    header, SPEC §4.1), and the logs then name the id made up here."""
    if len(values) == 1 and _ACCEPTED.fullmatch(values[0]):
        return Correlation(values[0], header)
    return Correlation(new_request_id(), header, made=not values)


_VERSION_4 = 0x4 << 76  # RFC 9562 §5.4
_VARIANT = 0b10 << 62  # RFC 9562 §4.1
_FIXED_BITS = ~(0xF << 76 | 0b11 << 62)


def new_request_id() -> str:
    """A random UUID (version 4) in its canonical 8-4-4-4-12 text, as `str(uuid.uuid4())` but
    without building a uuid.UUID: three Python calls less on every request that brings no id."""
    try:
        value = RANDOM_128.pop()
    except IndexError:
        value = refill()
    value = value & _FIXED_BITS | _VERSION_4 | _VARIANT
    digits = f"{value:032x}"
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def traced(trace_id: int, span_id: int) -> Correlation | None:
    """The current correlation with the request's trace and server span (OpenTelemetry's ids,
    written as W3C Trace Context writes them)."""
    correlation = CURRENT.get()
    if correlation is None:
        return None
    return replace(correlation, trace_id=f"{trace_id:032x}", span_id=f"{span_id:016x}")


def current_fields() -> dict[str, str]:
    """The current request's ids as log fields; none outside a request."""
    correlation = CURRENT.get()
    return {} if correlation is None else correlation.fields()
