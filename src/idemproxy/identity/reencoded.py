"""What a client changes when it encodes one request anew for each try (SPEC §6).

SDKs build a request again before each retry. Two encodings then differ in bytes that say
nothing about the payload: a multipart body's `boundary` (httpx, requests and the SDKs built on
them draw a new one per try) and a gzip header's time stamp. Hashed as sent, such a retry was
`409 payload-mismatch` with `retry: new-key-safe`, and a client that followed that hint ran the
request twice. The digests here leave those bytes out, and only those: two bodies with the same
digest are the same bytes but for them, and every parser reads them alike.
"""

from __future__ import annotations

import hashlib
import mmap
from typing import TypeAlias

# What a body is read from: its bytes, or its spooled file mapped into memory.
Body: TypeAlias = bytes | mmap.mmap

# RFC 2046 §5.1.1: `bchars`, of which a boundary has 1 to 70, the last not a space.
_BOUNDARY_CHARS = frozenset(
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? "
)
_MAX_BOUNDARY = 70
_CRLF, _DASHES = b"\r\n", b"--"
# RFC 1952 §2.3: ID1 ID2 CM (8, deflate), FLG, then MTIME in the next four bytes.
_GZIP_MAGIC = b"\x1f\x8b\x08"
_GZIP_FLAGS = 3
_GZIP_FHCRC = 0x02  # a CRC of the header, MTIME included, follows it
_GZIP_MTIME = slice(4, 8)


def multipart_boundary(value: str) -> bytes | None:
    """A `boundary` parameter's value as bytes, or None when RFC 2046 would not take it (then
    the body is hashed as sent, as before)."""
    try:
        boundary = value.encode("ascii")
    except UnicodeEncodeError:
        return None
    if not 0 < len(boundary) <= _MAX_BOUNDARY or boundary.endswith(b" "):
        return None
    return boundary if _BOUNDARY_CHARS.issuperset(boundary) else None


def parts_digest(body: Body, boundary: bytes) -> bytes | None:
    """SHA-256 of a multipart body whatever its boundary (RFC 2046 §5.1.1), or None when the body
    is not strictly one under it (then it is hashed as sent).

    Strictly: the boundary occurs nowhere but in delimiters, each at the very start of the body
    or after a CRLF, as `--boundary`, followed by `--` (the close delimiter, the last one) or by
    a CRLF (no transport padding: a parser that does not take it reads content there). Then
    every parser, strict or lenient (one that takes a bare LF, or finds a delimiter in the
    middle of a line), cuts the body at those delimiters and nowhere else, and the body is the
    same form under any other boundary that leaves it so. What lies between delimiters is
    hashed whole (the preamble, each part with the rest of its delimiter's line, the epilogue
    after the close delimiter), and the digest is the hash of those hashes. A body that opens
    with its first delimiter is read as if a CRLF came before it.
    """
    with memoryview(body) as view:  # released before a mapped file is closed
        return _parts_digest(body, view, boundary)


def _parts_digest(body: Body, view: memoryview, boundary: bytes) -> bytes | None:
    parts = hashlib.sha256()
    width = len(boundary)
    begun = 0  # where the segment being read begins
    closed = False
    found = body.find(boundary)
    if found < 0:
        return None
    while found >= 0:
        dashes = found - len(_DASHES)
        if closed or dashes < 0 or body[dashes:found] != _DASHES:
            return None  # after the close delimiter, or not a delimiter's
        if dashes == 0:
            segment = hashlib.sha256()  # an empty preamble
        elif dashes >= len(_CRLF) and body[dashes - len(_CRLF) : dashes] == _CRLF:
            segment = hashlib.sha256(_CRLF if begun == 0 else b"")
            segment.update(view[begun : dashes - len(_CRLF)])
        else:
            return None  # inside a line
        parts.update(segment.digest())
        begun = found + width
        if body[begun : begun + len(_DASHES)] == _DASHES:
            closed = True
        elif body[begun : begun + len(_CRLF)] != _CRLF:
            # Something else after the boundary: content, to a parser, or transport padding,
            # which RFC 2046 allows and not every parser takes (then it reads content there).
            return None
        found = body.find(boundary, found + 1)
    if not closed:
        return None
    parts.update(hashlib.sha256(view[begun:]).digest())
    return parts.digest()


def gzip_digest(body: Body) -> bytes:
    """SHA-256 of a gzip body (RFC 1952 §2.3) with its first member's MTIME read as zero: a
    client compressing the same bytes again a second later writes another time stamp, which
    the backend's decoding never reads. Everything else counts as sent (another compression
    level is other bytes, as any other coding), and bytes that are not gzip, or whose header
    carries a CRC (FHCRC: it covers MTIME, and a strict decoder refuses a stale one), are hashed
    as they are."""
    with memoryview(body) as view:
        if (
            len(body) < _GZIP_MTIME.stop
            or body[: len(_GZIP_MAGIC)] != _GZIP_MAGIC
            or body[_GZIP_FLAGS] & _GZIP_FHCRC
        ):
            return hashlib.sha256(view).digest()
        sha = hashlib.sha256(view[: _GZIP_MTIME.start])
        sha.update(bytes(_GZIP_MTIME.stop - _GZIP_MTIME.start))
        sha.update(view[_GZIP_MTIME.stop :])
        return sha.digest()
