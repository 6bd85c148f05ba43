"""What an operator resolves an `unknown` job to, checked once for the API and CLI (SPEC §3.3).

A `completed` resolution is stored and later replayed like an upstream response (SPEC §7), so it
must be one that a replay can send: a final status, well-formed end-to-end headers that the proxy
would have stored itself, and a body within `max_stored_body`.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from idemproxy.config.settings import Settings
from idemproxy.constants import MAX_RESOLVED_HEADER_BYTES
from idemproxy.core.types import HeaderPairs, JobState, StoredResponse
from idemproxy.errors import InvalidRequest
from idemproxy.http.headers import headers_to_store

# RFC 9110 §5.1 field-name = token; §5.5 field-value: visible ASCII, SP and HTAB (obs-text is
# legal but deprecated, and what a replay would encode it as is not worth guessing).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NOT_FIELD_VALUE = re.compile(r"[^\t\x20-\x7e]")
# RFC 9110 §15.3.5, §15.4.5: these statuses never carry content.
_NO_CONTENT = frozenset({204, 304})
_JSON_FIELDS = frozenset(
    {"as", "status", "headers", "body", "body_base64", "version", "from_attempt"}
)


@dataclass(frozen=True, slots=True)
class ResponseRules:
    """What a stored response may contain, from the settings the proxy stores with.

    Header limits are the proxy's own for a head it receives (`server.max_headers` fields of at
    most `server.max_field_size` bytes each, as `Name: value`), and at most
    `MAX_RESOLVED_HEADER_BYTES` in all: a resolution is replayed to every client of the job, so
    headers no client could take in would break each of them.
    """

    unreplayed_headers: Collection[str]
    max_body: int
    max_headers: int = 128
    max_field_size: int = 8190

    @classmethod
    def from_settings(cls, settings: Settings) -> ResponseRules:
        server = settings.server
        return cls(
            settings.unreplayed_headers,
            settings.max_stored_body,
            server.max_headers,
            server.max_field_size,
        )


@dataclass(frozen=True, slots=True)
class Resolution:
    """`released`, or `completed` with the response the upstream really gave.

    `version`, when given, must be the job's current version (the operator saw that job).
    """

    state: JobState
    response: StoredResponse | None = None
    version: int | None = None
    # `completed` with the response attempt N really had, kept when it came too late (SPEC
    # §3.3); the store supplies `response`.
    from_attempt: int | None = None


def released(version: int | None = None) -> Resolution:
    return Resolution(JobState.RELEASED, None, version)


def completed(
    status: int,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    rules: ResponseRules,
    version: int | None = None,
) -> Resolution:
    _check_status(status, body)
    if len(body) > rules.max_body:
        raise InvalidRequest(f"body: {len(body)} bytes is over max_stored_body ({rules.max_body})")
    pairs = _check_headers(headers, rules)
    return Resolution(JobState.COMPLETED, StoredResponse(status, pairs, body), version)


def from_attempt(number: int, version: int | None = None) -> Resolution:
    """`completed` with attempt `number`'s kept late response (its headers and body are the
    upstream's own, stored as a replay would store them)."""
    if number < 1:
        raise InvalidRequest("the attempt number must be 1 or more")
    return Resolution(JobState.COMPLETED, None, version, number)


def parse_header_line(line: str) -> tuple[str, str]:
    """`Name: value` as given on the command line."""
    name, sep, value = line.partition(":")
    if not sep or not _TOKEN.fullmatch(name):
        raise InvalidRequest(f"header {line!r}: expected 'Name: value'")
    return name, value.strip(" \t")


def resolution_from_json(data: Any, rules: ResponseRules) -> Resolution:
    """The body of `POST /jobs/{id}/resolve`."""
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    if not set(data) <= _JSON_FIELDS:
        raise InvalidRequest(f"unknown field; allowed: {', '.join(sorted(_JSON_FIELDS))}")
    version = _optional_int(data, "version")
    target = data.get("as")
    if target == JobState.RELEASED.value:
        if not set(data) <= {"as", "version"}:
            raise InvalidRequest('"as": "released" takes no status, headers or body')
        return released(version)
    if target == JobState.COMPLETED.value:
        number = _optional_int(data, "from_attempt")
        if number is not None:
            if not set(data) <= {"as", "version", "from_attempt"}:
                raise InvalidRequest('"from_attempt" takes no status, headers or body')
            return from_attempt(number, version)
        status = _optional_int(data, "status")
        if status is None:
            raise InvalidRequest('"as": "completed" needs a "status"')
        headers = _json_headers(data.get("headers", []))
        return completed(status, headers, _json_body(data), rules, version)
    raise InvalidRequest('"as" must be "released" or "completed"')


def _check_status(status: int, body: bytes) -> None:
    if not 200 <= status <= 599:
        raise InvalidRequest("status: must be a final status, 200-599")
    if status in _NO_CONTENT and body:
        raise InvalidRequest(f"status {status} never carries a body")


def _check_headers(headers: Sequence[tuple[str, str]], rules: ResponseRules) -> HeaderPairs:
    if len(headers) > rules.max_headers:
        raise InvalidRequest(
            f"{len(headers)} headers is over server.max_headers ({rules.max_headers})"
        )
    total = 0
    for name, value in headers:
        _check_field(name, value, rules.max_field_size)
        total += len(name) + len(value) + 4  # `: ` and CRLF, as sent
    if total > MAX_RESOLVED_HEADER_BYTES:
        raise InvalidRequest(f"headers: {total} bytes in all is over {MAX_RESOLVED_HEADER_BYTES}")
    pairs = tuple((name, value) for name, value in headers)
    kept = headers_to_store(CIMultiDict(pairs), rules.unreplayed_headers)
    if len(kept) != len(pairs):
        # SPEC §7: a replay recomputes framing and Date, never sends hop-by-hop headers, and
        # does not replay `unreplayed_headers`; storing them would only break or leak a replay.
        dropped = sorted({n for n, _ in pairs} - {n for n, _ in kept})
        raise InvalidRequest(f"header(s) never replayed, leave them out: {', '.join(dropped)}")
    return pairs


def _check_field(name: str, value: str, max_field_size: int) -> None:
    if not _TOKEN.fullmatch(name):
        raise InvalidRequest("header names must be RFC 9110 tokens")
    if _NOT_FIELD_VALUE.search(value):
        raise InvalidRequest(f"header {name}: only visible ASCII, spaces and tabs")
    if value != value.strip(" \t"):
        # RFC 9110 §5.5: a field value has no leading or trailing whitespace; a parser strips
        # it, so the proxy never stores a value with any from an upstream either.
        raise InvalidRequest(f"header {name}: no leading or trailing spaces or tabs")
    if len(name) + 2 + len(value) > max_field_size:
        raise InvalidRequest(
            f"header {name}: {len(name) + 2 + len(value)} bytes as 'Name: value' is over "
            f"server.max_field_size ({max_field_size})"
        )


def _json_headers(value: Any) -> list[tuple[str, str]]:
    """`[["Name", "value"], …]` (order and repeats kept) or `{"Name": "value"}`."""
    items = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(items, list):
        raise InvalidRequest('"headers" must be a list of [name, value] pairs')
    pairs: list[tuple[str, str]] = []
    for item in items:
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise InvalidRequest('"headers" must be a list of [name, value] pairs')
        name, value = item
        if not (isinstance(name, str) and isinstance(value, str)):
            raise InvalidRequest("header names and values must be strings")
        pairs.append((name, value))
    return pairs


def _json_body(data: Mapping[str, Any]) -> bytes:
    text, encoded = data.get("body"), data.get("body_base64")
    if text is not None and encoded is not None:
        raise InvalidRequest('give "body" or "body_base64", not both')
    if encoded is not None:
        if not isinstance(encoded, str):
            raise InvalidRequest('"body_base64" must be a string')
        try:
            return base64.b64decode(encoded, validate=True)
        except binascii.Error as exc:
            raise InvalidRequest('"body_base64" is not valid base64') from exc
    if text is not None and not isinstance(text, str):
        raise InvalidRequest('"body" must be a string (use "body_base64" for bytes)')
    try:
        return (text or "").encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate escaped in the JSON
        raise InvalidRequest('"body" is not valid Unicode; use "body_base64"') from exc


def _optional_int(data: Mapping[str, Any], name: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f'"{name}" must be an integer')
    return value
