"""Content codings on a replay (SPEC §7): which ones a retry accepts, and decoding the ones the
proxy can (RFC 9110 §8.4.1: `gzip` and `deflate`, with the standard library only)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Final

# RFC 9110 §8.4.1.3, §8.4.1.1: the `x-` names are the same codings.
_ALIASES: Final = {"x-gzip": "gzip", "x-compress": "compress"}
DECODABLE: Final = frozenset({"gzip", "deflate"})
# zlib's `wbits` for a gzip member (16 + 15) and for RFC 1950 data and raw RFC 1951 data.
_GZIP, _ZLIB, _RAW = 31, 15, -15
# SPEC §7: the work of a decode stays in proportion to the stored bytes. Each coding of a
# chain may decode to as much as the limit, so a chain is at most this long (servers apply
# one coding; RFC 9110 §8.4 allows more, nobody sends more than two).
MAX_CODINGS: Final = 4
# The first piece of a gzip member given to its decoder (a member is at least 18 bytes).
_FIRST_PIECE: Final = 64


class Undecodable(Exception):
    """The body cannot be decoded (an unknown coding, corrupt bytes, or more than the limit)."""


def coding_names(values: Iterable[str]) -> list[str]:
    """The codings of `Content-Encoding` fields in the order they were applied (RFC 9110
    §8.4), lower-cased, `identity` left out."""
    names = (token.strip().lower() for value in values for token in value.split(","))
    return [_ALIASES.get(name, name) for name in names if name and name != "identity"]


def accepts(accept_encoding: list[str] | None, coding: str) -> bool:
    """Whether a request with these `Accept-Encoding` fields takes `coding` (RFC 9110 §12.5.3).

    RFC 9110 lets a server send any coding to a request without the field; a replay does not
    (SPEC §7): the stored answer's coding was chosen for the first request's field, and a client
    that sends none (curl, most libraries left to themselves) cannot decode it. A weight that
    does not parse is taken as `q=0`: decoding is always safe, a coding the client cannot read
    never is."""
    if accept_encoding is None:
        return False
    weights = _weights(accept_encoding)
    weight = weights.get(coding, weights.get("*", 0.0))
    return weight > 0


def _weights(fields: list[str]) -> dict[str, float]:
    weights: dict[str, float] = {}
    for element in ",".join(fields).split(","):
        name, *parameters = (part.strip() for part in element.split(";"))
        if not name:
            continue
        name = _ALIASES.get(name.lower(), name.lower())
        weight = _weight(parameters)
        # A coding listed twice counts with its lower weight.
        weights[name] = min(weight, weights.get(name, weight))
    return weights


def _weight(parameters: list[str]) -> float:
    for parameter in parameters:
        key, _, value = parameter.partition("=")
        if key.strip().lower() == "q":
            try:
                weight = float(value.strip())
            except ValueError:
                return 0.0
            return weight if 0 <= weight <= 1 else 0.0
    return 1.0


def decode(body: bytes, codings: list[str], limit: int) -> bytes:
    """`body` with every coding in `codings` undone, last applied first; `Undecodable` when one
    is not `gzip` or `deflate`, the bytes are not what it says, or the result exceeds `limit`
    bytes (SPEC §9: `max_stored_body` bounds what a replay holds), or there are more than
    `MAX_CODINGS` of them. The work is linear in `body` and the output (SPEC §7)."""
    if len(codings) > MAX_CODINGS or any(coding not in DECODABLE for coding in codings):
        raise Undecodable()
    for coding in reversed(codings):
        body = _gunzip(body, limit) if coding == "gzip" else _inflate(body, limit)
    return body


def _gunzip(body: bytes, limit: int) -> bytes:
    # RFC 1952 §2.2: a gzip body may be several members, one after the other. The members are
    # read in place (a view, an offset) and their output gathered in one buffer: decoding is
    # linear in the body, however many members it has (each pass over the rest would make
    # many tiny members quadratic).
    view = memoryview(body)
    out = bytearray()
    start = 0
    while start < len(view):
        start = _member(view, start, out, limit)
    return bytes(out)


def _member(view: memoryview, start: int, out: bytearray, limit: int) -> int:
    """The gzip member at `start` decoded onto `out` (which stays within `limit` bytes); where
    the bytes after it begin. The decoder is fed pieces that double in size: what it copies
    after the member's end (its `unused_data`) is at most twice what the member itself took,
    never the whole rest of the body."""
    decoder = zlib.decompressobj(_GZIP)
    size = _FIRST_PIECE
    while not decoder.eof:
        piece = view[start : start + size]
        if not piece:
            raise Undecodable()  # cut off before the member's end
        start += len(piece)
        try:
            out += decoder.decompress(piece, limit - len(out) + 1)
        except zlib.error as exc:
            raise Undecodable() from exc
        if len(out) > limit:
            raise Undecodable()
        size *= 2
    return start - len(decoder.unused_data)


def _inflate(body: bytes, limit: int) -> bytes:
    # RFC 9110 §8.4.1.2: `deflate` is the zlib format; some servers send raw deflate instead.
    try:
        out, rest = _bounded(_ZLIB, body, limit)
    except Undecodable:
        out, rest = _bounded(_RAW, body, limit)
    if rest:
        raise Undecodable()  # bytes after the end of the stream
    return out


def _bounded(wbits: int, data: bytes, limit: int) -> tuple[bytes, bytes]:
    """One stream decoded, at most `limit` bytes of it, and the bytes after its end."""
    decoder = zlib.decompressobj(wbits)
    try:
        out = decoder.decompress(data, limit + 1)
    except zlib.error as exc:
        raise Undecodable() from exc
    if len(out) > limit or not decoder.eof:
        raise Undecodable()  # over the limit, or cut off before the stream's end
    return out, decoder.unused_data
