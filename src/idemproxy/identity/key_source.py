"""Where a route finds its key when it is not the `Idempotency-Key` header (SPEC §4.1): another
named header, or a JSON Pointer (RFC 6901) into the JSON body, with an optional prefix."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDictProxy

from idemproxy.errors import KeyAmbiguous, KeyInvalid
from idemproxy.identity import deep_json
from idemproxy.identity.intent import check_characters, parse_key

# RFC 6901 §4: an array index is "0" or ASCII digits without a leading zero (`²` and `१` are
# digits to `str.isdigit`, and no index).
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")


@dataclass(frozen=True, slots=True)
class KeySource:
    """`header` or `pointer` (its reference tokens, unescaped), and `prefix`."""

    header: str | None = None
    pointer: tuple[str, ...] | None = None
    prefix: str = ""

    @classmethod
    def of(cls, header: str | None, pointer: str | None, prefix: str) -> KeySource:
        return cls(header, None if pointer is None else pointer_tokens(pointer), prefix)

    @property
    def needs_body(self) -> bool:
        return self.pointer is not None

    def key(self, headers: CIMultiDictProxy[str], body: bytes) -> str | None:
        """The key, or None when the source is absent; `KeyInvalid` when it is not a key."""
        if self.pointer is not None:
            return self.body_key(body)
        value = parse_key(headers.getall(self.header or "", []))
        return None if value is None else self.prefixed(value)

    def body_key(self, body: bytes) -> str | None:
        """`key` of a pointer source, from the body alone (it may run in another process:
        http/offload.py)."""
        value = None if self.pointer is None else _pointed(body, self.pointer)
        return None if value is None else self.prefixed(value)

    def prefixed(self, value: str) -> str:
        key = self.prefix + value
        check_characters(key)
        return key


def pointer_tokens(pointer: str) -> tuple[str, ...]:
    """RFC 6901 §4: `~1` is `/` and `~0` is `~`, in that order."""
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in pointer.split("/")[1:])


def _pointed(body: bytes, tokens: Sequence[str]) -> str | None:
    """The string (or integer, as Shopify's ids are) at `tokens`; None when the body is not
    JSON or nothing is there; `KeyInvalid` for any other value, `KeyAmbiguous` when an object on
    the way repeats the name the pointer takes."""
    node = _document(body)
    if node is _NOT_JSON:
        return None
    for token in tokens:
        if isinstance(node, dict):
            if token not in node:
                return None
            if isinstance(node, _Repeating) and token in node.repeated:
                raise KeyAmbiguous()
            node = node[token]
        elif isinstance(node, list) and _ARRAY_INDEX.fullmatch(token):
            index = int(token)
            if index >= len(node):
                return None
            node = node[index]
        else:
            return None
    if isinstance(node, str):
        return str(node)
    if node is None:
        return None
    raise KeyInvalid("The key's field in the body is not a string or an integer.")


class _IntegerText(str):
    """An integer token as it was written: never converted, so that a body with a number
    beyond `int`'s digit limit elsewhere still names its key (RFC 8259 §6 sets no limit)."""

    __slots__ = ()


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")  # RFC 8259 §6: no NaN or Infinity


class _Repeating(dict[str, Any]):
    """An object that repeats member names (`repeated`). RFC 8259 §4 leaves which value counts
    to the parser, so a pointer through such a name names no key that can be told; through any
    other member it reads as usual (SPEC §4.1; §6 hashes such a body's raw bytes)."""

    __slots__ = ("repeated",)

    def __init__(self, pairs: list[tuple[str, Any]], repeated: frozenset[str]) -> None:
        super().__init__(pairs)
        self.repeated = repeated


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    members = dict(pairs)
    if len(members) == len(pairs):
        return members
    seen: set[str] = set()
    repeated: set[str] = set()
    for name, _ in pairs:
        (repeated if name in seen else seen).add(name)
    return _Repeating(pairs, frozenset(repeated))


# Strict RFC 8259: an integer stays its text, a float is parsed (it is never a key anyway).
_DECODER = json.JSONDecoder(
    parse_int=_IntegerText, parse_constant=_refuse_constant, object_pairs_hook=_members
)
_NOT_JSON = object()


def _document(body: bytes) -> Any:
    """The JSON text of the body, or `_NOT_JSON`. RFC 8259 §8.1: JSON exchanged between systems
    is UTF-8 without a byte order mark; a body in UTF-16 or UTF-32 names no key."""
    try:
        text = body.decode("utf-8")
        try:
            return _DECODER.decode(text)
        except RecursionError:  # deeper than the C parser goes: a key at any depth is found
            return deep_json.loads(text, _DECODER)
    except ValueError:  # UnicodeDecodeError is a ValueError
        return _NOT_JSON
