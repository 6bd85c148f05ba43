"""proxy/server/chunks.py: where a chunked body ends, however its reads are cut (RFC 9112 §7.1)."""

from __future__ import annotations

import pytest

from idemproxy.proxy.server.chunks import (
    GAVE_UP,
    LINES_PER_READ,
    ChunkWalk,
    begins_head,
)

BODIES = [
    b"0\r\n\r\n",
    b"2\r\n{}\r\n0\r\n\r\n",
    b'1;ext=1\r\n{\r\n1;q="a;b"\r\n}\r\n0\r\n\r\n',
    b"A\r\n0123456789\r\n000\r\nX-Trailer: 1\r\nY: 2\r\n\r\n",
    b"5\r\n0\r\n\r\n\r\n0\r\n\r\n",  # chunk data that looks like the last chunk
    b"2 \r\nab\r\n0\t\r\n\r\n",  # whitespace after a size
]
NEXT = b"GET /next HTTP/1.1\r\nHo"


def chunked_end(data: bytes, at: int) -> int | None:
    """Where a chunked body that starts at `at` ends, when `data` holds all of it."""
    end = ChunkWalk().feed(data, at)
    return None if end is None or end == GAVE_UP else end


@pytest.mark.parametrize("body", BODIES)
def test_a_body_in_one_read_ends_where_the_next_request_begins(body: bytes) -> None:
    assert chunked_end(body + NEXT, 0) == len(body)
    assert chunked_end(b"HEAD" + body, 4) == 4 + len(body)


@pytest.mark.parametrize("body", BODIES)
def test_every_cut_into_two_reads_finds_the_same_end(body: bytes) -> None:
    whole = body + NEXT
    for cut in range(1, len(whole)):
        walk = ChunkWalk()
        first = walk.feed(whole[:cut])
        if cut >= len(body):
            assert first == len(body), cut
            continue
        assert first is None, cut
        assert walk.feed(whole[cut:]) == len(body) - cut, cut


def test_a_body_cut_byte_by_byte_ends_at_its_blank_line() -> None:
    body = BODIES[3]
    walk = ChunkWalk()
    ends = [walk.feed(body[n : n + 1]) for n in range(len(body))]
    assert ends[:-1] == [None] * (len(body) - 1) and ends[-1] == 1


@pytest.mark.parametrize("framing", [b"zz\r\n", b"\r\n", b"-1\r\n", b"0x2\r\nab\r\n"])
def test_what_is_not_chunked_framing_is_given_up(framing: bytes) -> None:
    assert ChunkWalk().feed(framing + NEXT) == GAVE_UP
    assert chunked_end(framing + NEXT, 0) is None


def test_more_lines_than_one_read_walks_are_given_up() -> None:
    tiny = b"1\r\nx\r\n" * LINES_PER_READ + b"0\r\n\r\n"
    assert ChunkWalk().feed(tiny) == GAVE_UP
    assert chunked_end(b"1\r\nx\r\n" * 10 + b"0\r\n\r\n", 0) == 60 + 5


def test_an_incomplete_body_is_no_end() -> None:
    assert chunked_end(b"5\r\nab", 0) is None
    assert chunked_end(b"2\r\nab\r\n0\r\nTrailer: 1\r\n", 0) is None


@pytest.mark.parametrize(
    ("data", "begun"),
    [(b"", False), (b"\r\n", False), (b"\r\n\r\n\n", False), (b"G", True), (b"\r\nGET", True)],
)
def test_empty_lines_begin_no_head(data: bytes, begun: bool) -> None:
    assert begins_head(b"xx" + data, 2) is begun
