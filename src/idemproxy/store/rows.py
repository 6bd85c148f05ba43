"""Turning database rows into the plain `Job`/`Attempt` data of `idemproxy.core.types`, and
stored header pairs into JSON and back.

Header pairs are kept as JSON byte for byte (SPEC §7). In the proxy a header value is the text
aiohttp and proxy/upstream/client.py make of its bytes: UTF-8, and each byte outside a UTF-8
sequence (obs-text such as ISO-8859-1 `é`, RFC 9110 §5.5) as a lone surrogate escape. JSON text
can not hold a lone surrogate: PostgreSQL's `jsonb` refuses `\\udce9`, and so do strict JSON
readers. A pair whose name or value holds one is therefore kept as its bytes read as
ISO-8859-1 (every byte one character), marked by a third element:
`["X-Name", "caf\\u00e9", "latin-1"]`. Every other pair is kept as it always was, so rows and
cache entries written before read the same.
"""

from __future__ import annotations

import functools
import itertools
import json
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

from idemproxy.core.states import ATTEMPT_STATE_OF, JOB_STATE_OF
from idemproxy.core.types import (
    Attempt,
    AttemptState,
    Evidence,
    HeaderPairs,
    Job,
    JobState,
    KeptResponse,
    SealedResponse,
    StoredResponse,
)
from idemproxy.store.base import LateResponse

# The key id of a row that holds no headers in the clear and names no key (SPEC §11): no ring
# holds it (`parse_key_ring` refuses an empty id), so such a row is always refused.
NO_KEY_ID = ""

# Distinct stored header lists kept parsed (see `decode_headers`); each is a few hundred bytes.
_PARSED_HEADERS = 64
# One encoder for every completion's headers: `json.dumps` with `separators` builds a new one
# per call. The text is the same character for character.
_HEADERS_JSON = json.JSONEncoder(separators=(",", ":"))
_BYTES = "latin-1"  # the mark of a header pair kept as its bytes


class Row(Protocol):
    """asyncpg.Record and sqlite3.Row alike."""

    def __getitem__(self, key: str, /) -> Any: ...


def job_from_row(row: Row, attempts: tuple[Attempt, ...] = ()) -> Job:
    # Flat: every claim, completion and store read turns a row into a Job here.
    value = row["state"]
    state = JOB_STATE_OF.get(value)
    if state is None:
        state = JobState(value)  # an unknown value raises ValueError
    created, updated, expires = row["created_at"], row["updated_at"], row["expires_at"]
    if not isinstance(created, datetime):  # SQLite's Unix seconds (PostgreSQL's are aware)
        created, updated, expires = as_datetime(created), as_datetime(updated), as_datetime(expires)
    return Job(
        id=str(row["id"]),
        owner=row["owner"],
        key=row["key"],
        fingerprint=row["fingerprint"],
        state=state,
        version=row["version"],
        attempt_count=row["attempt_count"],
        method=row["method"],
        path=row["path"],
        completed_by=row["completed_by"],
        response=None if row["response_status"] is None else _response(row),
        created_at=created,
        updated_at=updated,
        expires_at=expires,
        expired=bool(row["expired"]),
        lease_expired=bool(row["lease_expired"]),
        resolution=row["resolution"],
        attempts=attempts,
        started_by=None if row["started_by"] is None else str(row["started_by"]),
    )


def attempt_from_row(row: Row) -> Attempt:
    return Attempt(
        number=row["number"],
        upstream=row["upstream"],
        state=_attempt_state(row["state"]),
        status=row["status"],
        error=row["error"],
        started_at=as_datetime(row["started_at"]),
        finished_at=as_datetime(row["finished_at"]),
        late_bytes=row["late_bytes"],
        checks=row["checks"],
        checked_at=as_datetime(row["checked_at"]),
        evidence=evidence_from_json(row["evidence"]),
        sent_digest=row["sent_digest"],
    )


def evidence_to_json(evidence: Evidence) -> str:
    """One entry of an attempt's evidence as stored (SPEC §3.6)."""
    answered = evidence.answered_at
    return json.dumps(
        {
            "way": evidence.way,
            "asked_at": evidence.asked_at.isoformat(),
            "answered_at": None if answered is None else answered.isoformat(),
            "status": evidence.status,
            "verdict": evidence.verdict,
            "reason": evidence.reason,
        }
    )


def evidence_from_json(text: str | None) -> tuple[Evidence, ...]:
    if text is None:
        return ()
    return tuple(_evidence(entry) for entry in json.loads(text))


def _evidence(entry: dict[str, Any]) -> Evidence:
    answered = entry["answered_at"]
    return Evidence(
        way=entry["way"],
        asked_at=datetime.fromisoformat(entry["asked_at"]),
        answered_at=None if answered is None else datetime.fromisoformat(answered),
        status=entry["status"],
        verdict=entry["verdict"],
        reason=entry["reason"],
    )


def late_response_from_row(row: Row) -> KeptResponse:
    """A late response kept on its attempt (queries.sql `get_late_response`)."""
    body = bytes(row["late_body"])
    key_id = row["late_key"]
    if key_id is not None or row["late_headers"] is None:
        return SealedResponse(row["status"], False, key_id or NO_KEY_ID, body)
    return StoredResponse(row["status"], decode_headers(row["late_headers"]), body)


def late_from_row(row: Row) -> LateResponse:
    """A late response with its job's identity (queries.sql `late_responses_to_reseal`)."""
    response = late_response_from_row(row)
    return LateResponse(row["owner"], str(row["job_id"]), row["key"], row["number"], response)


class ResponseColumns(NamedTuple):
    """A response as its columns hold it: headers as JSON text (None when sealed), the body
    or the sealed box, the id of the key it is sealed with (None in the clear), and whether
    its body was omitted."""

    headers: str | None
    body: bytes | None
    key_id: str | None
    omitted: bool


def response_columns(response: KeptResponse) -> ResponseColumns:
    if isinstance(response, SealedResponse):
        return ResponseColumns(None, response.sealed, response.key_id, response.omitted)
    # `encode_headers`, written out: every completion's. `omitted` read from the body, not
    # through StoredResponse's property (a frame of its own).
    body = response.body
    headers = _HEADERS_JSON.encode(pairs_to_json(response.headers))
    return ResponseColumns(headers, body, None, body is None)


def _attempt_state(value: str) -> AttemptState:
    state = ATTEMPT_STATE_OF.get(value)
    return AttemptState(value) if state is None else state


def _response(row: Row) -> KeptResponse | None:
    if row["response_status"] is None:
        return None
    key_id = row["response_key"]
    # SPEC §11: sealed, opened only to be replayed or shown. A response in the clear always has
    # its headers; one with none is a box whose key id was cleared, kept sealed so that it is
    # refused, never replayed as it is.
    if key_id is not None or row["response_headers"] is None:
        return SealedResponse(
            row["response_status"],
            bool(row["response_omitted"]),
            key_id or NO_KEY_ID,
            bytes(row["response_body"] or b""),
        )
    body = None if row["response_omitted"] else bytes(row["response_body"] or b"")
    return StoredResponse(row["response_status"], decode_headers(row["response_headers"]), body)


def encode_headers(headers: HeaderPairs) -> str:
    # ASCII JSON (escaped), with no lone surrogate: jsonb takes it (`pairs_to_json`).
    return _HEADERS_JSON.encode(pairs_to_json(headers))


def decode_headers(value: str | list[list[str]] | None) -> HeaderPairs:
    if value is None:
        return ()
    if isinstance(value, str):
        return _parsed_headers(value)
    return _pairs(value)


@functools.lru_cache(maxsize=_PARSED_HEADERS)
def _parsed_headers(value: str) -> HeaderPairs:
    # Every replay of a job reads the same stored headers, and one upstream's responses often
    # store identical ones: the result is an immutable function of the text, so it is kept.
    return _pairs(json.loads(value))


def _pairs(pairs: list[list[str]]) -> HeaderPairs:
    return pairs_from_json(pairs)


def pairs_to_json(headers: HeaderPairs) -> list[list[str]]:
    # An all-ASCII list (nearly every response's) holds no surrogate: each pair as it is, tested
    # and copied by C-level calls rather than a Python call per pair.
    if "".join(itertools.chain.from_iterable(headers)).isascii():
        return list(map(list, headers))
    return [_pair_to_json(name, value) for name, value in headers]


def pairs_from_json(pairs: list[Any]) -> HeaderPairs:
    """The pairs `pairs_to_json` made; ValueError or TypeError for anything else."""
    return tuple([_pair_from_json(pair) for pair in pairs])


def _pair_to_json(name: str, value: str) -> list[str]:
    if name.isascii() and value.isascii():
        return [name, value]
    try:
        name.encode(), value.encode()  # strict UTF-8: no surrogate escape in either
    except UnicodeEncodeError:
        return [_as_latin1(name), _as_latin1(value), _BYTES]
    return [name, value]


def _pair_from_json(pair: list[Any]) -> tuple[str, str]:
    if len(pair) == 2:
        return str(pair[0]), str(pair[1])
    name, value, mark = pair
    if mark != _BYTES:
        raise ValueError(f"unknown header pair encoding {mark!r}")
    return _from_latin1(str(name)), _from_latin1(str(value))


def _as_latin1(text: str) -> str:
    return text.encode("utf-8", "surrogateescape").decode("latin-1")


def _from_latin1(text: str) -> str:
    return text.encode("latin-1").decode("utf-8", "surrogateescape")


def as_datetime(value: datetime | float | None) -> datetime | None:
    """PostgreSQL gives aware datetimes; SQLite stores Unix seconds from its own clock."""
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromtimestamp(value, tz=UTC)
