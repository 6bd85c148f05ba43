"""JSON at any depth (SPEC §4.1, §6): a parser and a canonical writer without recursion.

The standard `json` decoder and encoder recurse in C, one level of the interpreter's recursion
limit per nesting level: a valid body about 1,000 levels deep raises `RecursionError`, and a key
in it would be missed. RFC 8259 §9 lets a parser limit nesting, but the body is valid JSON that
the backend may parse, so the proxy must read it whole. The fast C path stays the first choice
(key_source.py, intent.py); this module is the fallback, with an explicit stack, that gives
the same values and writes the same text for every document the C path handles.
"""

from __future__ import annotations

import json
import re
from json.decoder import JSONDecodeError
from json.encoder import encode_basestring
from typing import Any

from idemproxy.errors import BodyTooLarge

_WHITESPACE = re.compile(r"[ \t\n\r]*")  # RFC 8259 §2


class Verbatim:
    """A value the canonical writer writes as `text`, unchanged (a number token a float would
    change, in intent.py)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


class _Members:
    """An object being read: its (name, value) pairs so far and the name awaiting a value."""

    __slots__ = ("name", "pairs")

    def __init__(self, name: str) -> None:
        self.pairs: list[tuple[str, Any]] = []
        self.name = name


# The stack parser costs about 10 times what the C parser does: for 1 MiB, its key and its
# canonical form take 0.8 to 1.2 s, about what the C parser takes for the largest default body
# (10 MiB). A text too deep for the C parser and longer than this is refused rather than read
# (SPEC §9), never passed through untracked.
MAX_DEEP_TEXT = 1024 * 1024


def loads(text: str, decoder: json.JSONDecoder) -> Any:
    """`decoder.decode(text)` without recursion: the same hooks called in the same order, so the
    same value (or the same kind of error: `ValueError`, or what a hook raises). `BodyTooLarge`
    for a text longer than `MAX_DEEP_TEXT`."""
    if len(text) > MAX_DEEP_TEXT:
        raise BodyTooLarge(
            "The JSON body nests deeper than about 1,000 levels and is longer than 1 MiB: "
            "too large to read at that depth (SPEC §9)."
        )
    value, end = _document(text, _skip(text, 0), decoder)
    if _skip(text, end) != len(text):
        raise JSONDecodeError("Extra data", text, end)
    return value


def _document(text: str, pos: int, decoder: json.JSONDecoder) -> tuple[Any, int]:
    stack: list[list[Any] | _Members] = []
    while True:
        value, pos = _opened(text, pos, decoder, stack)
        if value is _OPENED:
            continue
        while True:  # the value is complete: hand it to the containers it closes
            if not stack:
                return value, pos
            top = stack[-1]
            pos = _skip(text, pos)
            char = text[pos : pos + 1]
            if isinstance(top, list):
                top.append(value)
                closer = "]"
            else:
                top.pairs.append((top.name, value))
                closer = "}"
            if char == ",":
                pos = _skip(text, pos + 1)
                if isinstance(top, _Members):
                    top.name, pos = _member_name(text, pos, decoder)
                break
            if char != closer:
                raise JSONDecodeError(f"Expecting ',' delimiter or {closer!r}", text, pos)
            stack.pop()
            value = top if isinstance(top, list) else _object(top.pairs, decoder)
            pos += 1


_OPENED = object()


def _opened(
    text: str, pos: int, decoder: json.JSONDecoder, stack: list[list[Any] | _Members]
) -> tuple[Any, int]:
    """The value at `pos`, or `_OPENED` with a new container pushed on `stack`."""
    char = text[pos : pos + 1]
    if char == "[":
        pos = _skip(text, pos + 1)
        if text[pos : pos + 1] == "]":
            return [], pos + 1
        stack.append([])
        return _OPENED, pos
    if char == "{":
        pos = _skip(text, pos + 1)
        if text[pos : pos + 1] == "}":
            return _object([], decoder), pos + 1
        name, pos = _member_name(text, pos, decoder)
        stack.append(_Members(name))
        return _OPENED, pos
    return _scalar(text, pos, decoder)


def _member_name(text: str, pos: int, decoder: json.JSONDecoder) -> tuple[str, int]:
    """The name at `pos` and the position of its value, after the `:`."""
    if text[pos : pos + 1] != '"':
        raise JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
    name, pos = _scalar(text, pos, decoder)
    pos = _skip(text, pos)
    if text[pos : pos + 1] != ":":
        raise JSONDecodeError("Expecting ':' delimiter", text, pos)
    return name, _skip(text, pos + 1)


def _scalar(text: str, pos: int, decoder: json.JSONDecoder) -> tuple[Any, int]:
    """A string, literal or number: the C scanner itself reads it (no container, no recursion),
    with the decoder's hooks; `JSONDecodeError` when no value starts at `pos`."""
    value, end = decoder.raw_decode(text, pos)
    return value, end


def _object(pairs: list[tuple[str, Any]], decoder: json.JSONDecoder) -> Any:
    hook = decoder.object_pairs_hook
    return dict(pairs) if hook is None else hook(pairs)


def _skip(text: str, pos: int) -> int:
    if text[pos : pos + 1] not in _BLANKS:  # most JSON has no space between tokens: no regex
        return pos
    match = _WHITESPACE.match(text, pos)
    assert match is not None  # the pattern matches the empty string
    return match.end()


_BLANKS = " \t\n\r"


def canonical(document: Any, encoder: json.JSONEncoder, *, sliced: bool = False) -> str:
    """What `json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)` writes
    for `document`, at any depth, with every `Verbatim` written as its text. `encoder` is that
    encoder: it writes each number and literal.

    `sliced` writes the members of a container wider than `_SLICE` by one call of the C encoder
    per `_SLICE` of them (walked, if one is deep or holds a Verbatim): the C encoder never lets
    another thread run while it works, so a large body written whole would hold the event loop
    even from a worker thread (http/offload.py); between two slices, it can run.
    """
    parts: list[str] = []
    # What is left to write, last first: values, and the punctuation between them as Verbatim.
    pending: list[Any] = [document]
    while pending:
        node = pending.pop()
        if isinstance(node, Verbatim):
            parts.append(node.text)
        elif isinstance(node, _Slice):
            _write_slice(node.members, encoder, parts, pending)
        elif isinstance(node, str):
            parts.append(encode_basestring(node))
        elif isinstance(node, dict):
            pending.append(_CLOSE_OBJECT)
            _push(node, pending, sliced)
            parts.append("{")
        elif isinstance(node, list):
            pending.append(_CLOSE_ARRAY)
            _push(node, pending, sliced)
            parts.append("[")
        else:
            parts.append(encoder.encode(node))
    return "".join(parts)


_SLICE = 256


class _Slice:
    """Consecutive members of a container, written by one call of the C encoder."""

    __slots__ = ("members",)

    def __init__(self, members: dict[str, Any] | list[Any]) -> None:
        self.members = members


def _push(node: dict[str, Any] | list[Any], pending: list[Any], sliced: bool) -> None:
    """Push the members of `node` and the punctuation between them on `pending`, last first."""
    if not (sliced and len(node) > _SLICE):
        _push_members(node, pending)
        return
    slices: list[dict[str, Any] | list[Any]]
    if isinstance(node, dict):
        names = sorted(node)
        slices = [{n: node[n] for n in names[i : i + _SLICE]} for i in range(0, len(names), _SLICE)]
    else:
        slices = [node[i : i + _SLICE] for i in range(0, len(node), _SLICE)]
    for index in range(len(slices) - 1, -1, -1):
        pending.append(_Slice(slices[index]))
        if index:
            pending.append(_COMMA)


def _push_members(node: dict[str, Any] | list[Any], pending: list[Any]) -> None:
    if isinstance(node, dict):
        for index, name in reversed(list(enumerate(sorted(node)))):
            pending.append(node[name])
            pending.append(Verbatim(("," if index else "") + encode_basestring(name) + ":"))
        return
    for index in range(len(node) - 1, -1, -1):
        pending.append(node[index])
        if index:
            pending.append(_COMMA)


def _write_slice(
    members: dict[str, Any] | list[Any],
    encoder: json.JSONEncoder,
    parts: list[str],
    pending: list[Any],
) -> None:
    try:
        parts.append(encoder.encode(members)[1:-1])  # without the brackets of the slice
    except (TypeError, RecursionError):  # a Verbatim, or deeper than the C encoder goes
        _push_members(members, pending)


_CLOSE_OBJECT, _CLOSE_ARRAY, _COMMA = Verbatim("}"), Verbatim("]"), Verbatim(",")
