"""One result line: self-describing, so that the results file alone says what happened (SPEC §14).

    {"v": 1, "id": "q-17", "outcome": "done", "status": 201, "replayed": false, "attempts": 1,
     "body": {…}, "body_encoding": "json", "content_type": "application/json",
     "error": null, "error_code": null, "retryable": false, "key": "batch:q-17:…",
     "request_hash": "…", "meta": …, "started_at": "…Z", "finished_at": "…Z",
     "key_header": "Idempotency-Key", "usage": {"input_tokens": 31, …} or null}

`outcome` is `done` (a final answer below 400), `failed` (a final error answer, or transient
failures until the retries ran out: then `retryable` is true) or `unknown` (the proxy cannot know
whether the request executed: `409 outcome-unknown`, SPEC §3.2). `status` is the HTTP status of
the last answer, null when no answer came. `body_encoding` says how `body` holds the answer:
`json` (parsed), `text`, `base64`, or `none`. Request headers are never written: they may carry
credentials.

Every line must be readable by any JSON parser, whatever the upstream answered: a body is kept as
`json` only if it can be written back as strict JSON (UTF-8 without lone surrogates, no `NaN` or
`Infinity`, not nested deeper than the encoder goes), else as `text` or `base64`; strings taken
from response headers (aiohttp keeps undecodable bytes as lone surrogates) are made valid text.
`usage` holds the tokens the answer reported (`input_tokens`, `output_tokens`, `total_tokens`
and the `model`), null when it reported none (usage.py); `run` names the run that wrote the line
(the time it started), so that `batch status` can total the last run apart.
`worst_case` (null unless set) says a try was sent and no answer said what it did — a timeout, a
connection lost after sending, `outcome-unknown`: it may have executed and been paid, and a budget
counts it at this worst case until an answer for its key says what it used. On a `done` line it
says the answer did not say what it used (a stream without usage, a plain-text body): it was paid,
and a budget counts it at this worst case. `sent_before` marks a
replay that answers such a try of this batch: its execution was this batch's, and paid.
`omitted` is a final answer whose body the proxy did not store (`Idempotency-Replay: omitted`,
SPEC §7): the request executed once, but its body is gone and a rerun cannot bring it back.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from idemproxy.batch.constants import RECORD_VERSION


class Outcome(StrEnum):
    DONE = "done"
    FAILED = "failed"
    UNKNOWN = "unknown"
    OMITTED = "omitted"


@dataclass(frozen=True)
class ResultRecord:
    id: str
    outcome: Outcome
    status: int | None
    replayed: bool
    attempts: int
    body: Any
    body_encoding: str
    content_type: str | None
    error: str | None
    error_code: str | None
    retryable: bool
    key: str
    request_hash: str
    meta: Any
    started_at: str
    finished_at: str
    key_header: str | None = None  # the header the key went in; None in files of older runs
    usage: Any = None  # {"input_tokens", "output_tokens", "total_tokens", "model"} (usage.py)
    run: str | None = None  # when the run that wrote the line started; None in older files
    # Set when a try was sent and no answer said what it did (usage.WorstCase.to_json): it may
    # have executed and been paid; or when the answer of the execution did not say what it used.
    # None once an answer of the execution said it, and in older files.
    worst_case: Any = None
    # A replay answering a try of this batch that was sent without an answer (in this run, or
    # one whose line has a `worst_case`): the replayed execution is this batch's own, and paid.
    sent_before: bool = False

    def to_line(self) -> bytes:
        """One JSON line, ending in a newline: the unit that is appended and fsynced.

        Raises ValueError (or RecursionError) for a record that strict JSON cannot carry; the
        runner then writes a `failed` record for the item instead (runner.py).
        """
        # Not dataclasses.asdict: it deep-copies the body in Python recursion, which a body
        # nested a few hundred deep (that the C encoder writes fine) exhausts.
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        return strict_json({"v": RECORD_VERSION, **values, "outcome": self.outcome.value}) + b"\n"

    @classmethod
    def from_object(cls, obj: object) -> ResultRecord:
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        try:
            required = {name: obj[name] for name in _REQUIRED}
            outcome = Outcome(obj["outcome"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"not a result line ({exc})") from exc
        optional = {name: obj.get(name, default) for name, default in _OPTIONAL.items()}
        return cls(**{**required, **optional, "outcome": outcome, "id": str(obj["id"])})


_REQUIRED = ("id", "outcome", "key", "request_hash")
_OPTIONAL: dict[str, Any] = {
    "status": None,
    "replayed": False,
    "attempts": 0,
    "body": None,
    "body_encoding": "none",
    "content_type": None,
    "error": None,
    "error_code": None,
    "retryable": False,
    "meta": None,
    "started_at": "",
    "finished_at": "",
    "key_header": None,
    "usage": None,
    "run": None,
    "worst_case": None,
    "sent_before": False,
}

_SURROGATE = re.compile("[\ud800-\udfff]")

# Every line starts with these bytes (to_line writes "v" first, then the fields in order): a
# tail without a newline is a torn result only if it begins with them (checkpoint.py).
LINE_START: bytes = b'{"v":%d,"id":' % RECORD_VERSION


def strict_json(value: Any) -> bytes:
    """UTF-8 JSON that every parser reads: no NaN/Infinity, no lone surrogates (RFC 8259 §6, §8.1).

    Raises ValueError (UnicodeEncodeError is one) or TypeError for a value that is not such
    JSON, RecursionError for one nested too deep.
    """
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode()


def valid_text(value: str | None) -> str | None:
    """A string from the wire made writable: lone surrogates become U+FFFD."""
    if value is None:
        return None
    return _SURROGATE.sub("\ufffd", value)


def encode_body(data: bytes, content_type: str | None) -> tuple[Any, str]:
    """The answer's body as a JSON value and its encoding: parsed JSON, text, or base64."""
    if not data:
        return None, "none"
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        parsed = _writable_json(data)
        if parsed is not None:
            return parsed[0], "json"
        # A broken body, or one strict JSON cannot carry back (a lone surrogate from a cut
        # emoji, NaN, 1e999, nesting deeper than the encoder goes): keep the bytes as they came.
    try:
        return data.decode(), "text"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode(), "base64"


def _writable_json(data: bytes) -> tuple[Any] | None:
    """The parsed body, in a 1-tuple, if it parses and can be written back as strict JSON."""
    try:
        value = json.loads(data, parse_constant=_no_constant)
        strict_json(value)
    except (ValueError, RecursionError):
        return None
    return (value,)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
