"""One result line: self-describing, so that the results file alone says what happened (SPEC §14).

    {"v": 1, "id": "q-17", "outcome": "done", "status": 201, "replayed": false, "attempts": 1,
     "body": {…}, "body_encoding": "json", "content_type": "application/json",
     "error": null, "error_code": null, "retryable": false, "key": "batch:q-17:…",
     "request_hash": "…", "meta": …, "started_at": "…Z", "finished_at": "…Z"}

`outcome` is `done` (a final answer below 400), `failed` (a final error answer, or transient
failures until the retries ran out: then `retryable` is true) or `unknown` (the proxy cannot know
whether the request executed: `409 outcome-unknown`, SPEC §3.2). `status` is the HTTP status of
the last answer, null when no answer came. `body_encoding` says how `body` holds the answer:
`json` (parsed), `text`, `base64`, or `none`. Request headers are never written: they may carry
credentials.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from idemproxy.batch.constants import RECORD_VERSION


class Outcome(StrEnum):
    DONE = "done"
    FAILED = "failed"
    UNKNOWN = "unknown"


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

    def to_line(self) -> bytes:
        """One JSON line, ending in a newline: the unit that is appended and fsynced."""
        fields = {"v": RECORD_VERSION, **asdict(self), "outcome": self.outcome.value}
        return json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_object(cls, obj: object) -> ResultRecord:
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        try:
            fields = {name: obj[name] for name in _REQUIRED}
            outcome = Outcome(obj["outcome"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"not a result line ({exc})") from exc
        optional = {name: obj.get(name, default) for name, default in _OPTIONAL.items()}
        return cls(**{**fields, **optional, "outcome": outcome, "id": str(obj["id"])})


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
}


def encode_body(data: bytes, content_type: str | None) -> tuple[Any, str]:
    """The answer's body as a JSON value and its encoding: parsed JSON, text, or base64."""
    if not data:
        return None, "none"
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        try:
            return json.loads(data), "json"
        except ValueError:
            pass  # a JSON content type with a broken body: keep the bytes as they came
    try:
        return data.decode(), "text"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode(), "base64"


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
