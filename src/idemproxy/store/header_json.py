"""Stored header pairs as JSON, byte for byte (SPEC §7). Pure.

In the proxy a header value is the text aiohttp and proxy/upstream/h1.py make of its bytes: UTF-8,
and each byte outside a UTF-8 sequence (obs-text such as ISO-8859-1 `é`, RFC 9110 §5.5) as a lone
surrogate escape. JSON text can not hold a lone surrogate: PostgreSQL's `jsonb` refuses
`\\udce9`, and so do strict JSON readers. A pair whose name or value holds one is therefore
kept as its bytes read as ISO-8859-1 (every byte one character), marked by a third element:
`["X-Name", "caf\\u00e9", "latin-1"]`. Every other pair is kept as it always was, so rows and
cache entries written before read the same.
"""

from __future__ import annotations

from typing import Any

from idemproxy.core.types import HeaderPairs

_BYTES = "latin-1"  # the mark of a pair kept as its bytes


def pairs_to_json(headers: HeaderPairs) -> list[list[str]]:
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
