"""Pure decisions of the client: what an answer means, and how long to wait before the next try.

The retry is always under the same key (SPEC §14), so it can never execute twice behind the
proxy: it is held while the first attempt runs, replayed once it completed, or told
`outcome-unknown` if the first may have executed.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import Enum

from idemproxy.batch.constants import (
    GATEWAY_FAILURES,
    RETRY_AFTER_CAP_SECONDS,
    TRANSIENT_STATUSES,
)
from idemproxy.errors import (
    NEVER,
    NEW_KEY_SAFE,
    SAME_KEY,
    OutcomeUnknown,
    PayloadMismatch,
    RequestInFlight,
    TooManyWaiters,
)

_RNG = random.Random()


class Verdict(Enum):
    DONE = "done"
    FAILED = "failed"
    UNKNOWN = "unknown"
    OMITTED = "omitted"
    RETRY = "retry"


# SPEC §8: what the proxy's own problem says the client may do next.
_ADVICE = {SAME_KEY: Verdict.RETRY, NEW_KEY_SAFE: Verdict.FAILED, NEVER: Verdict.UNKNOWN}
# SPEC §8 `job_state`: the key's job is running. Without the member (an older proxy's problem),
# the codes that are only ever given about a job in flight say the same.
IN_FLIGHT = "in_flight"
_IN_FLIGHT_CODES = frozenset({RequestInFlight.code, TooManyWaiters.code})


def classify(
    status: int,
    error_code: str | None,
    *,
    replayed: bool = False,
    omitted: bool = False,
    advice: str | None = None,
) -> Verdict:
    """What an answer means for the item.

    `error_code` is the `Idempotency-Error` header, `replayed` the `Idempotent-Replayed` one,
    `omitted` says `Idempotency-Replay: omitted`, `advice` the `retry` member of the proxy's
    problem document (SPEC §8). The advice decides where there is one: `same-key` is retried
    under the same key, `new-key-safe` is final (this key will never succeed; nothing ran),
    `never` is `unknown` (it may have executed). The rules below are the fallback for answers
    without it: an older proxy's, or another API's that honours `Idempotency-Key`.
    """
    if error_code is not None and advice in _ADVICE:
        return _ADVICE[advice]
    if error_code == OutcomeUnknown.code:
        # SPEC §3.2: it may have executed; only an operator can say (§3.3). Never retried.
        return Verdict.UNKNOWN
    if error_code == RequestInFlight.code:
        return Verdict.RETRY  # SPEC §2: still running under this key; ask again later
    if error_code == PayloadMismatch.code:
        return Verdict.FAILED  # SPEC §8: the key was used for another intent; retrying is futile
    if replayed or omitted:
        # SPEC §7: the stored answer of the one execution. Asking again replays the same bytes,
        # so even a 409 or a 503 the upstream gave is final; without its body it is `omitted`.
        return _final(status, omitted=omitted)
    if status == 409 or status in TRANSIENT_STATUSES:
        # A plain 409 is how APIs that honour Idempotency-Key say "this key is in use".
        return Verdict.RETRY
    return _final(status)


# The verdicts of an answer that says what the execution used, if it reports usage. Not
# `omitted`: a replay without its body (SPEC §7) says it executed, never what it used.
_SETTLING = frozenset({Verdict.DONE, Verdict.FAILED})


def may_have_executed(
    status: int, error_code: str | None, verdict: Verdict, job_state: str | None = None
) -> bool:
    """Whether an answer says the request may have executed without saying what it did.

    SPEC §3.2: `outcome-unknown` and the proxy's other `never` answers, or a gateway of the
    upstream's own that failed (it may have passed the request on). A proxy problem that is
    retried under the same key started nothing itself; but one that says the key's job is in
    flight (SPEC §8 `job_state`: `request-in-flight`, `too-many-waiters`, a `store-unavailable`
    whose outcome awaits its write) says an execution of this very key runs: one a killed run
    of this batch started, say, which will be paid whatever this run does.
    """
    gateway = error_code is None and status in GATEWAY_FAILURES
    in_flight = job_state == IN_FLIGHT or (job_state is None and error_code in _IN_FLIGHT_CODES)
    return verdict is Verdict.UNKNOWN or (verdict is Verdict.RETRY and (gateway or in_flight))


def settles(error_code: str | None, verdict: Verdict) -> bool:
    """Whether an answer is the execution's own (or its replay): a final answer that is not a
    problem of the proxy's. It ends any doubt a try that went unanswered left (SPEC §14)."""
    return error_code is None and verdict in _SETTLING


def problem_advice(body: bytes) -> str | None:
    """The `retry` member of a problem document (SPEC §8); None if the body has none."""
    return problem_standing(body)[0]


def problem_standing(body: bytes) -> tuple[str | None, str | None]:
    """The `retry` and `job_state` members of a problem document (SPEC §8), each None when
    the body has no such member with a value the SPEC names."""
    try:
        document = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
        return None, None
    if not isinstance(document, dict):
        return None, None
    advice, state = document.get("retry"), document.get("job_state")
    return (
        advice if advice in _ADVICE else None,
        state if state in _JOB_STATES else None,
    )


_JOB_STATES = frozenset({"none", IN_FLIGHT, "completed", "released", "unknown"})


def _final(status: int, *, omitted: bool = False) -> Verdict:
    if omitted:
        return Verdict.OMITTED
    return Verdict.DONE if status < 400 else Verdict.FAILED


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """RFC 9110 §10.2.3: delay-seconds or an HTTP-date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # str.isdigit alone takes "²", which float refuses
        return min(float(value), RETRY_AFTER_CAP_SECONDS)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    delay = (when - (now or datetime.now(UTC))).total_seconds()
    return min(max(delay, 0.0), RETRY_AFTER_CAP_SECONDS)


def backoff_seconds(retry: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter for the `retry`-th retry (1-based).

    Half the delay is fixed and half random, so that workers that failed together (a reset that
    cut every connection) do not come back together, and none comes back at once.
    """
    ceiling = min(cap, base * 2 ** (retry - 1))
    jitter = (rng or _RNG).uniform(0, ceiling / 2)
    return float(ceiling / 2 + jitter)


def next_delay(
    retry: int, retry_after: float | None, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """The backoff, but never less than the server's Retry-After.

    Retry-After is the least the server asks for; a server that keeps saying "1 second"
    (a store that is down, SPEC §8) still gets an ever gentler retry.
    """
    backoff = backoff_seconds(retry, base, cap, rng)
    return backoff if retry_after is None else max(retry_after, backoff)
