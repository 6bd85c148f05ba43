"""Parsing and validating the Idempotency-Key header (SPEC §4)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from idemproxy.constants import KEY_MAX_LENGTH
from idemproxy.errors import KeyInvalid

_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]*")  # one C loop, not a Python one per character


def parse_key(values: Sequence[str]) -> str | None:
    """The normalised key from every value of the header, or None when it is absent.

    The RFC 8941 sf-string form (`"abc"`) and a bare token (`abc`) give the same key. More than one
    header line, a comma-joined list, or anything outside 1-255 visible ASCII is `key-invalid`.
    """
    if not values:
        return None
    if len(values) > 1:
        raise KeyInvalid("Send exactly one Idempotency-Key header.")
    raw = values[0].strip(" \t")
    if raw.startswith('"'):
        key = _unquote(raw)
    elif '"' in raw or "," in raw or "\\" in raw:
        raise KeyInvalid("A bare key may not contain quotes, commas or backslashes.")
    else:
        key = raw
    # `check_characters`'s tests, in place for a valid key; it says what is wrong otherwise.
    if not 1 <= len(key) <= KEY_MAX_LENGTH or _VISIBLE_ASCII.fullmatch(key) is None:
        check_characters(key)
    return key


def _unquote(raw: str) -> str:
    # RFC 8941 §3.3.3: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE
    chars: list[str] = []
    escaped = False
    for index, char in enumerate(raw[1:], start=1):
        if escaped:
            if char not in '"\\':
                raise KeyInvalid('Only \\" and \\\\ may be escaped in a quoted key.')
            chars.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            if index != len(raw) - 1:
                raise KeyInvalid("A quoted key must be a single sf-string.")
            return "".join(chars)
        else:
            chars.append(char)
    raise KeyInvalid("The quoted key is not terminated.")


def check_characters(key: str) -> None:
    if not 1 <= len(key) <= KEY_MAX_LENGTH:
        raise KeyInvalid(f"The key must be 1-{KEY_MAX_LENGTH} characters long.")
    if _VISIBLE_ASCII.fullmatch(key) is None:
        raise KeyInvalid("The key may contain visible ASCII characters only.")
