"""Where a chunked request body ends, read by read (RFC 9112 §7.1), for the head deadline
(proxy/server/connection.py): what follows it in the same read is the next request's head.

aiohttp's parser reads the chunks; it does not say where in a read a body ended. `ChunkWalk`
follows the same framing alongside it, without keeping any of the body: the chunk sizes, the
bytes left of the current chunk, a size or trailer line cut by a read's end. Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

_HEX: Final = b"0123456789abcdefABCDEF"
# Lines (chunk sizes, trailer fields) walked at most in one read: aiohttp parses them in C, this
# walk in Python, so a read of thousands of tiny chunks must not cost a request much more.
LINES_PER_READ: Final = 256
# A size or trailer line longer than aiohttp's parser takes (max_field_size, 8190) is refused
# there: no need to keep more of one here.
_LONGEST_LINE: Final = 8192
GAVE_UP: Final = -1  # not chunked framing, or not worth following: the caller stops following


class ChunkWalk:
    """One chunked body, fed every read that holds some of it, in order."""

    __slots__ = ("_cut", "_left", "_trailers", "lines_out")

    def __init__(self) -> None:
        self._left = 0  # bytes of the current chunk's data and its CRLF still to come
        self._cut = b""  # the start of a line the last read ended in
        self._trailers = False  # the last chunk was read: trailer fields, then a blank line
        # GAVE_UP because a read held more lines than LINES_PER_READ (or one too long), not
        # because the framing is wrong.
        self.lines_out = False

    def feed(self, data: bytes, at: int = 0) -> int | None:
        """Where in `data` (from `at`) the body ends, just past its blank line; None when it
        goes on in a later read; GAVE_UP when its framing is not one to follow."""
        for _ in range(LINES_PER_READ):
            if self._left:
                taken = min(self._left, len(data) - at)
                self._left -= taken
                at += taken
                if self._left:
                    return None
            line_and_next = self._line(data, at)
            if line_and_next is None:
                if len(self._cut) <= _LONGEST_LINE:
                    return None
                self.lines_out = True
                return GAVE_UP
            line, at = line_and_next
            if self._trailers:
                if not line:
                    return at
                continue
            size = line.partition(b";")[0].strip(b" \t")
            if not size or size.strip(_HEX):
                return GAVE_UP
            length = int(size, 16)
            if length:
                self._left = length + 2
            else:
                self._trailers = True
        self.lines_out = True
        return GAVE_UP

    def _line(self, data: bytes, at: int) -> tuple[bytes, int] | None:
        """The next whole line and where the bytes after it begin; None when this read ends in
        it (kept for the next)."""
        if self._cut.endswith(b"\r") and data[at : at + 1] == b"\n":  # CRLF cut between reads
            line, self._cut = self._cut[:-1], b""
            return line, at + 1
        end = data.find(b"\r\n", at)
        if end == -1:
            self._cut += data[at:]
            return None
        line, self._cut = self._cut + data[at:end], b""
        return line, end + 2


def begins_head(data: bytes, at: int) -> bool:
    """Whether bytes of a next request follow `at`: empty lines before a request line are
    ignored (RFC 9112 §2.2), and a client that sends one owes no head."""
    return bool(data[at:].lstrip(b"\r\n"))
