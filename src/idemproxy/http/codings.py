"""Content codings on a replay (SPEC §7): which ones a retry accepts, and decoding the ones the
proxy can (RFC 9110 §8.4.1: `gzip` and `deflate`, with the standard library only)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
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
_MIN_MEMBER: Final = 18


class Undecodable(Exception):
    """The body cannot be decoded (an unknown coding, corrupt bytes, or more than the limit)."""


class OverBudget(Exception):
    """The decode has done more work than its `Budget` allows: finish it elsewhere (a thread)."""


@dataclass(slots=True)
class Budget:
    """Work a decode may do, counted over every coding of its chain (SPEC §7): bytes it writes
    and streams (gzip members, deflate streams) it opens. An empty gzip member writes nothing
    but costs a decoder: 150 stored bytes of three nested gzips held 400,000 of them."""

    output: int
    streams: int

    def spend(self, output: int, streams: int = 0) -> None:
        self.output -= output
        self.streams -= streams
        if self.output < 0 or self.streams < 0:
            raise OverBudget()


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


def decode(body: bytes, codings: list[str], limit: int, budget: Budget | None = None) -> bytes:
    """`body` with every coding in `codings` undone, last applied first; `Undecodable` when one
    is not `gzip` or `deflate`, the bytes are not what it says, or the result exceeds `limit`
    bytes (SPEC §9: `max_stored_body` bounds what a replay holds), or there are more than
    `MAX_CODINGS` of them, or more streams over all of them than the stored bytes can hold at
    one layer (a member is at least 18 bytes) and `MAX_CODINGS` more (a server codes one
    stream per coding). `OverBudget` when `budget` is spent first. The work is linear in `body` and
    the output (SPEC §7)."""
    if len(codings) > MAX_CODINGS or any(coding not in DECODABLE for coding in codings):
        raise Undecodable()
    meter = _Meter(Budget(limit * len(codings), len(body) // _MIN_MEMBER + MAX_CODINGS), budget)
    for coding in reversed(codings):
        body = _gunzip(body, limit, meter) if coding == "gzip" else _inflate(body, limit, meter)
    return body


@dataclass(slots=True)
class _Meter:
    """The bound on a decode's streams (past it the body is refused) and the caller's budget
    (past it the decode stops, to be finished elsewhere)."""

    bound: Budget
    budget: Budget | None

    def spend(self, output: int, streams: int = 0) -> None:
        try:
            self.bound.spend(output, streams)
        except OverBudget as exc:
            raise Undecodable() from exc
        if self.budget is not None:
            self.budget.spend(output, streams)

    def room(self, limit: int) -> int:
        """The most a decoder may write next: past `limit` the body is refused, past the
        budget the decode stops; one byte more tells which."""
        if self.budget is None:
            return limit + 1
        return min(limit, max(self.budget.output, 0)) + 1


def _gunzip(body: bytes, limit: int, meter: _Meter) -> bytes:
    # RFC 1952 §2.2: a gzip body may be several members, one after the other. The members are
    # read in place (a view, an offset) and their output gathered in one buffer: decoding is
    # linear in the body, however many members it has (each pass over the rest would make
    # many tiny members quadratic).
    view = memoryview(body)
    out = bytearray()
    start = 0
    while start < len(view):
        start = _member(view, start, out, limit, meter)
    return bytes(out)


def _member(view: memoryview, start: int, out: bytearray, limit: int, meter: _Meter) -> int:
    """The gzip member at `start` decoded onto `out` (which stays within `limit` bytes); where
    the bytes after it begin. The decoder is fed pieces that double in size: what it copies
    after the member's end (its `unused_data`) is at most twice what the member itself took,
    never the whole rest of the body."""
    meter.spend(0, 1)
    decoder = zlib.decompressobj(_GZIP)
    size = _FIRST_PIECE
    while not decoder.eof:
        piece = view[start : start + size]
        if not piece:
            raise Undecodable()  # cut off before the member's end
        start += len(piece)
        try:
            written = decoder.decompress(piece, meter.room(limit - len(out)))
        except zlib.error as exc:
            raise Undecodable() from exc
        out += written
        if len(out) > limit:
            raise Undecodable()
        meter.spend(len(written))  # stopped at `room`, it is over the budget
        size *= 2
    return start - len(decoder.unused_data)


def _inflate(body: bytes, limit: int, meter: _Meter) -> bytes:
    # RFC 9110 §8.4.1.2: `deflate` is the zlib format; some servers send raw deflate instead.
    # Only a body that does not begin with a zlib header is taken as raw: a zlib stream that
    # fails further on is corrupt, and read raw it would decode to other bytes.
    out, rest = _bounded(_ZLIB if _zlib_header(body) else _RAW, body, limit, meter)
    if rest:
        raise Undecodable()  # bytes after the end of the stream
    return out


def _zlib_header(body: bytes) -> bool:
    """RFC 1950 §2.2: method 8 (deflate), a window of at most 32 KiB, and a check that makes
    the two bytes a multiple of 31. A raw stream begins so only with a stored block whose
    padding bits are set, which encoders do not write (RFC 1951 §3.2.4)."""
    if len(body) < 2:
        return False
    cmf, flg = body[0], body[1]
    return cmf & 0x0F == 8 and cmf >> 4 <= 7 and (cmf << 8 | flg) % 31 == 0


def _bounded(wbits: int, data: bytes, limit: int, meter: _Meter) -> tuple[bytes, bytes]:
    """One stream decoded, at most `limit` bytes of it, and the bytes after its end."""
    meter.spend(0, 1)
    decoder = zlib.decompressobj(wbits)
    try:
        out = decoder.decompress(data, meter.room(limit))
    except zlib.error as exc:
        raise Undecodable() from exc
    if len(out) > limit:
        raise Undecodable()
    meter.spend(len(out))  # stopped at `room`, it is over the budget
    if not decoder.eof:
        raise Undecodable()  # cut off before the stream's end
    return out, decoder.unused_data
