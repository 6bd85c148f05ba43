"""The input file: one JSON object per line, each an item to send (SPEC §14).

    {"id": "q-17", "method": "POST", "path": "/v1/chat", "headers": {…}, "body": {…}, "meta": {…}}

`id` (a non-empty string or an integer) names the item in the results; `headers`, `body` and
`meta` are optional. `body` is sent as JSON, except that a string body with a non-JSON
`Content-Type` header is sent as that text. `meta` is not sent: it is copied to the item's result
line so that results carry whatever the caller needs to use them (a chapter, a row number).
Blank lines are ignored.

Everything that could fail later is refused here, with its line number, before anything is
sent: a `body` or `meta` that strict JSON cannot carry (a lone surrogate such as `"\\ud83d"`,
`NaN`, nesting too deep, and from Python anything that is not JSON at all), an `id` with a lone
surrogate, a header value with a control character (RFC 9110 §5.5).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from idemproxy.batch.errors import InvalidInput
from idemproxy.batch.records import strict_json
from idemproxy.constants import DEFAULT_KEY_HEADER

_FIELDS = frozenset({"id", "method", "path", "headers", "body", "meta"})
# RFC 9110 §5.6.2: token characters, for methods and header names.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_ID_MAX_LENGTH = 1024
# RFC 9110 §5.5: a field value is visible characters, spaces and tabs; no other control character
# (aiohttp refuses exactly these when it sends).
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f]")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Item:
    """One request of the batch, validated."""

    id: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    body: Any = None
    meta: Any = None
    line: int = 0

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    def payload(self) -> tuple[bytes | None, str | None]:
        """The body bytes to send and their content type (None, None without a body)."""
        if self.body is None:
            return None, None
        content_type = self.header("Content-Type")
        if isinstance(self.body, str) and content_type and not _is_json(content_type):
            return self.body.encode(), content_type
        # Canonical JSON: the same item always sends the same bytes, run after run.
        return canonical_json(self.body), content_type or "application/json"


@dataclass(frozen=True)
class InputFile:
    items: list[Item]
    invalid: list[str]  # "line N: why", for the lines that were left out


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def read_input(
    path: Path, *, skip_invalid: bool = False, key_header: str = DEFAULT_KEY_HEADER
) -> InputFile:
    """Parse and validate the whole file before anything is sent."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidInput([f"{path}: {exc.strerror or exc}"]) from exc
    items: list[Item] = []
    invalid: list[str] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            items.append(_parse_line(raw, number, key_header))
        except ValueError as exc:
            invalid.append(f"line {number}: {exc}")
    return _checked(items, invalid, skip_invalid=skip_invalid)


def items_from_objects(
    objects: Iterable[Mapping[str, Any]],
    *,
    skip_invalid: bool = False,
    key_header: str = DEFAULT_KEY_HEADER,
) -> InputFile:
    """The same validation for items given as Python objects; "line" is the 1-based position."""
    items: list[Item] = []
    invalid: list[str] = []
    for number, obj in enumerate(objects, start=1):
        try:
            items.append(item_from_object(obj, number, key_header))
        except ValueError as exc:
            invalid.append(f"line {number}: {exc}")
    return _checked(items, invalid, skip_invalid=skip_invalid)


def _checked(items: list[Item], invalid: list[str], *, skip_invalid: bool) -> InputFile:
    if invalid and not skip_invalid:
        raise InvalidInput(invalid, hint="Fix them, or pass --skip-invalid to leave them out.")
    # A duplicate id is never skipped: which of the two is meant cannot be guessed.
    duplicates = _duplicates(items)
    if duplicates:
        raise InvalidInput(duplicates, hint="Every item needs its own id.")
    return InputFile(items, invalid)


def _duplicates(items: list[Item]) -> list[str]:
    first: dict[str, int] = {}
    problems: list[str] = []
    for item in items:
        if item.id in first:
            problems.append(
                f"line {item.line}: duplicate id {item.id!r} (first on line {first[item.id]})"
            )
        else:
            first[item.id] = item.line
    return problems


def _parse_line(raw: bytes, number: int, key_header: str) -> Item:
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise ValueError("not UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
    except RecursionError as exc:
        raise ValueError("nested too deep to be read") from exc
    return item_from_object(obj, number, key_header)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def item_from_object(obj: object, line: int, key_header: str = DEFAULT_KEY_HEADER) -> Item:
    if not isinstance(obj, Mapping):
        raise ValueError("not a JSON object")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}")
    return Item(
        id=_item_id(obj.get("id")),
        method=_method(obj.get("method")),
        path=_path(obj.get("path")),
        headers=_headers(obj.get("headers"), key_header),
        body=_json_value("body", obj.get("body")),
        meta=_json_value("meta", obj.get("meta")),
        line=line,
    )


def _json_value(name: str, value: object) -> object:
    """`value` if it can be sent (body) or written to the results (meta) as strict JSON."""
    try:
        strict_json(value)
    except RecursionError as exc:
        raise ValueError(f'"{name}" is nested too deep to be written as JSON') from exc
    except UnicodeEncodeError as exc:
        raise ValueError(f'"{name}" has a lone surrogate (half of a UTF-16 pair)') from exc
    except (ValueError, TypeError) as exc:
        raise ValueError(f'"{name}" cannot be written as strict JSON ({exc})') from exc
    return value


def _item_id(value: object) -> str:
    if value is None:
        raise ValueError('missing "id"')
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError('"id" must be a string or an integer')
    text = str(value)
    if not text or len(text) > _ID_MAX_LENGTH:
        raise ValueError(f'"id" must be 1-{_ID_MAX_LENGTH} characters')
    if _SURROGATE.search(text):
        raise ValueError('"id" has a lone surrogate; it could not be written to the results')
    return text


def _method(value: object) -> str:
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise ValueError('"method" must be an HTTP method such as "POST"')
    return value.upper()


def _path(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError('"path" must be a string starting with "/"')
    if any(char.isspace() or not char.isprintable() for char in value):
        raise ValueError('"path" may not contain spaces or control characters')
    return value


def _headers(value: object, key_header: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError('"headers" must be an object of strings')
    headers: list[tuple[str, str]] = []
    for name, text in value.items():
        problem = header_problem(name, text)
        if problem:
            raise ValueError(f'"headers": {name!r} {problem}')
        if name.lower() == key_header.lower():
            raise ValueError(f'"headers": {name} is derived by the runner (SPEC §14), not given')
        headers.append((name, text))
    return tuple(headers)


def header_problem(name: object, value: object) -> str | None:
    """Why a header could not be sent as it is (RFC 9110 §5.1, §5.5), or None."""
    if not isinstance(name, str) or not isinstance(value, str) or not _TOKEN.fullmatch(name):
        return "must be a header name with a string value"
    if "\r" in value or "\n" in value:
        return "has a line break in its value"
    if _CONTROL.search(value) or _SURROGATE.search(value):
        return "has a control character in its value"
    return None


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")
