"""What a client changes when it encodes one request anew for each try (SPEC §6).

SDKs build a request again before each retry. Two encodings then differ in bytes that say
nothing about the payload: a multipart body's `boundary` (httpx, requests and the SDKs built on
them draw a new one per try) and a gzip header's time stamp. Hashed as sent, such a retry was
`409 payload-mismatch` with `retry: new-key-safe`, and a client that followed that hint ran the
request twice. The digests here leave those bytes out, and only those: two bodies with the same
digest are the same bytes but for them.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

# RFC 2046 §5.1.1: `bchars`, of which a boundary has 1 to 70, the last not a space.
_BOUNDARY_CHARS = frozenset(
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? "
)
_MAX_BOUNDARY = 70
# RFC 1952 §2.3: ID1 ID2 CM (8, deflate), FLG, then MTIME in the next four bytes.
_GZIP_MAGIC = b"\x1f\x8b\x08"
_GZIP_MTIME = slice(4, 8)
_GZIP_HEAD = 8


class Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def digest(self) -> bytes: ...


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


class PartsDigest:
    """SHA-256 of a multipart body whatever its boundary (RFC 2046 §5.1.1), fed as it arrives.

    The body is cut at each delimiter (CRLF, `--` and the boundary; the first may open the body,
    as if a line break came before it) and what lies between two delimiters is hashed whole: the
    preamble, each part with the rest of its delimiter's line (`--` closes the last), the
    epilogue. The digest is the hash of those hashes, in order. A boundary holds no line break,
    so no two delimiters overlap and the cuts are the ones every parser makes.
    """

    def __init__(self, boundary: bytes) -> None:
        self._delimiter = b"\r\n--" + boundary
        self._parts = hashlib.sha256()
        self._part = hashlib.sha256()
        self._pending = b"\r\n"  # the line break a first delimiter at the very start lacks

    def update(self, data: bytes, /) -> None:
        buffer = self._pending + data
        view, delimiter = memoryview(buffer), self._delimiter
        start = 0
        while (found := buffer.find(delimiter, start)) >= 0:
            self._part.update(view[start:found])
            self._parts.update(self._part.digest())
            self._part = hashlib.sha256()
            start = found + len(delimiter)
        # What may be the beginning of a delimiter waits for the next bytes.
        kept = max(start, len(buffer) - len(delimiter) + 1)
        self._part.update(view[start:kept])
        self._pending = buffer[kept:]

    def digest(self) -> bytes:
        part, parts = self._part.copy(), self._parts.copy()
        part.update(self._pending)
        parts.update(part.digest())
        return parts.digest()


class GzipDigest:
    """SHA-256 of a gzip body (RFC 1952 §2.3) with its first member's MTIME read as zero: a
    client compressing the same bytes again a second later writes another time stamp, which
    the backend's decoding never reads. Everything else counts as sent (another compression
    level is other bytes, as any other coding), and bytes that are not gzip are hashed as
    they are."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._head: bytes | None = b""

    def update(self, data: bytes, /) -> None:
        if self._head is None:
            self._sha.update(data)
            return
        head = self._head + data
        if len(head) < _GZIP_HEAD:
            self._head = head
            return
        self._head = None
        if head.startswith(_GZIP_MAGIC):
            head = head[: _GZIP_MTIME.start] + bytes(4) + head[_GZIP_MTIME.stop :]
        self._sha.update(head)

    def digest(self) -> bytes:
        sha = self._sha.copy()
        if self._head is not None:
            sha.update(self._head)
        return sha.digest()
