"""identity/reencoded.py: digests that leave out what a client changes between tries of one
request, and only that."""

from __future__ import annotations

import gzip
import hashlib
import mmap
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idemproxy.identity.reencoded import gzip_digest, multipart_boundary, parts_digest


def form(
    boundary: bytes, parts: list[bytes], preamble: bytes = b"", epilogue: bytes = b""
) -> bytes:
    body = preamble
    for part in parts:
        body += b"--" + boundary + b"\r\nContent-Type: text/plain\r\n\r\n" + part + b"\r\n"
    return body + b"--" + boundary + b"--\r\n"


BOUNDARY = st.text(
    alphabet="0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=?",
    min_size=1,
    max_size=70,
).map(str.encode)
PART = st.binary(max_size=60)


@given(BOUNDARY, BOUNDARY, st.lists(PART, max_size=4), st.binary(max_size=10))
def test_the_same_parts_give_one_digest_under_any_boundary_that_occurs_nowhere_else(
    one: bytes, other: bytes, parts: list[bytes], preamble: bytes
) -> None:
    first, second = parts_digest(form(one, parts, preamble), one), None
    if first is None:
        return  # the boundary occurs in a part or the preamble: hashed as sent
    second = parts_digest(form(other, parts, preamble), other)
    assert second in (first, None)


@given(BOUNDARY, st.lists(PART, min_size=1, max_size=4), st.lists(PART, min_size=1, max_size=4))
def test_other_parts_give_another_digest(
    boundary: bytes, parts: list[bytes], others: list[bytes]
) -> None:
    one, other = parts_digest(form(boundary, parts), boundary), None
    if parts != others:
        other = parts_digest(form(boundary, others), boundary)
        assert one is None or other is None or one != other


@given(st.binary(max_size=200), BOUNDARY)
def test_a_digest_is_given_only_to_a_body_whose_every_boundary_is_a_delimiter(
    body: bytes, boundary: bytes
) -> None:
    digest = parts_digest(body, boundary)
    if digest is None:
        return
    delimiters = (b"\r\n" + body).count(b"\r\n--" + boundary)
    assert body.count(boundary) == delimiters >= 1


BOUNDARY_A = b"Xy7Q-boundary"
FORM = form(BOUNDARY_A, [b"one", b"two"])


@pytest.mark.parametrize(
    "body",
    [
        # Reviewed cases: bytes a parser reads otherwise than as delimiters where the
        # boundary occurs (a longer line, a bare LF, the middle of a line, after the close).
        FORM.replace(b"one\r\n", b"one\r\n--" + BOUNDARY_A + b"Z\r\n"),
        FORM.replace(b"one\r\n", b"one\n--" + BOUNDARY_A + b"\r\n"),
        b"xyz--" + BOUNDARY_A + b"\r\n" + FORM,
        FORM + b"--" + BOUNDARY_A + b"\r\n",
        FORM.replace(b"two", b"t" + BOUNDARY_A + b"o"),
        FORM[: -len(b"--" + BOUNDARY_A + b"--\r\n")],  # never closed
        b"no delimiter at all",
    ],
    ids=["longer-line", "bare-lf", "mid-line", "after-close", "in-content", "unclosed", "none"],
)
def test_a_body_that_is_not_strictly_multipart_gets_no_digest(body: bytes) -> None:
    assert parts_digest(body, BOUNDARY_A) is None


def test_transport_padding_after_a_delimiter_is_hashed_as_sent() -> None:
    """RFC 2046 allows it; a parser that does not take it reads content there."""
    padded = FORM.replace(b"--" + BOUNDARY_A + b"\r\n", b"--" + BOUNDARY_A + b" \t\r\n", 1)
    assert parts_digest(padded, BOUNDARY_A) is None


def test_a_leading_line_break_is_a_preamble_of_its_own() -> None:
    assert parts_digest(b"\r\n" + FORM, BOUNDARY_A) != parts_digest(FORM, BOUNDARY_A)


def test_a_mapped_file_gives_the_digest_of_its_bytes() -> None:
    with tempfile.TemporaryFile() as spool:
        spool.write(FORM)
        spool.flush()
        with mmap.mmap(spool.fileno(), len(FORM), access=mmap.ACCESS_READ) as mapped:
            assert parts_digest(mapped, BOUNDARY_A) == parts_digest(FORM, BOUNDARY_A)
            assert gzip_digest(mapped) == gzip_digest(FORM)


def test_rfc_2046_boundaries() -> None:
    assert multipart_boundary("----WebKitFormBoundary7MA4YWxkTrZu0gW") is not None
    assert multipart_boundary("a b") == b"a b"
    for refused in ("", "a ", "x" * 71, "caf\u00e9", "a;b", "a\r\nb", 'a"b'):
        assert multipart_boundary(refused) is None, refused


# From 1: Python's gzip.compress writes another OS byte for a zero time stamp.
@given(st.binary(max_size=200), st.integers(1, 2**32 - 1), st.integers(1, 2**32 - 1))
def test_gzip_time_stamps_are_left_out(data: bytes, first: int, second: int) -> None:
    one = gzip_digest(gzip.compress(data, mtime=first))
    assert one == gzip_digest(gzip.compress(data, mtime=second))


@given(st.binary(max_size=40))
def test_bytes_that_are_no_gzip_are_hashed_as_they_are(data: bytes) -> None:
    if data.startswith(b"\x1f\x8b\x08") and len(data) >= 8:
        return
    assert gzip_digest(data) == hashlib.sha256(data).digest()
