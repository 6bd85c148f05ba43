"""identity/reencoded.py: digests that leave out what a client changes between tries of one
request, fed the body in any pieces (a spooled body is hashed as it arrives)."""

from __future__ import annotations

import gzip
import hashlib

from hypothesis import given
from hypothesis import strategies as st

from idemproxy.identity.reencoded import Digest, GzipDigest, PartsDigest, multipart_boundary


def fed(digest: Digest, body: bytes, cuts: list[int]) -> bytes:
    start = 0
    for cut in sorted(c % (len(body) + 1) for c in cuts):
        digest.update(body[start:cut] if cut >= start else b"")
        start = max(start, cut)
    digest.update(body[start:])
    return digest.digest()


def form(boundary: bytes, parts: list[bytes], preamble: bytes = b"") -> bytes:
    body = preamble
    for part in parts:
        body += b"--" + boundary + b"\r\nContent-Type: text/plain\r\n\r\n" + part + b"\r\n"
    return body + b"--" + boundary + b"--\r\n"


BOUNDARY = st.text(
    alphabet="0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=?",
    min_size=1,
    max_size=70,
).map(str.encode)
PART = st.binary(max_size=60).filter(lambda b: b"\r\n--" not in b)
CUTS = st.lists(st.integers(min_value=0, max_value=10_000), max_size=8)


@given(BOUNDARY, BOUNDARY, st.lists(PART, max_size=4), st.binary(max_size=10), CUTS, CUTS)
def test_the_same_parts_give_one_digest_under_any_boundary_in_any_pieces(
    one: bytes, other: bytes, parts: list[bytes], preamble: bytes, cuts: list[int], more: list[int]
) -> None:
    preamble = preamble.replace(b"\r\n", b"") + (b"\r\n" if preamble else b"")
    if any(b"\r\n--" + b in p or b"--" + b in preamble for b in (one, other) for p in parts):
        return  # not a valid form under that boundary
    first = fed(PartsDigest(one), form(one, parts, preamble), cuts)
    assert first == fed(PartsDigest(other), form(other, parts, preamble), more)


@given(BOUNDARY, st.lists(PART, min_size=1, max_size=4), st.lists(PART, min_size=1, max_size=4))
def test_other_parts_give_another_digest(
    boundary: bytes, parts: list[bytes], others: list[bytes]
) -> None:
    if parts == others or any(b"--" + boundary in p for p in parts + others):
        return
    one = PartsDigest(boundary)
    one.update(form(boundary, parts))
    other = PartsDigest(boundary)
    other.update(form(boundary, others))
    assert one.digest() != other.digest()


@given(st.binary(max_size=300), BOUNDARY, CUTS)
def test_any_bytes_give_the_digest_of_their_cuts(
    body: bytes, boundary: bytes, cuts: list[int]
) -> None:
    """Fed in pieces or whole, the digest is that of the body cut at every delimiter."""
    segments = (b"\r\n" + body).split(b"\r\n--" + boundary)
    expected = hashlib.sha256(b"".join(hashlib.sha256(s).digest() for s in segments)).digest()
    assert fed(PartsDigest(boundary), body, cuts) == expected


def test_a_delimiter_split_over_two_pieces_still_cuts() -> None:
    body = form(b"bound", [b"one", b"two"])
    whole = PartsDigest(b"bound")
    whole.update(body)
    for cut in range(len(body) + 1):
        assert fed(PartsDigest(b"bound"), body, [cut]) == whole.digest()


def test_rfc_2046_boundaries() -> None:
    assert multipart_boundary("----WebKitFormBoundary7MA4YWxkTrZu0gW") is not None
    assert multipart_boundary("a b") == b"a b"
    for refused in ("", "a ", "x" * 71, "caf\u00e9", "a;b", "a\r\nb", 'a"b'):
        assert multipart_boundary(refused) is None, refused


# From 1: Python's gzip.compress writes another OS byte for a zero time stamp.
@given(st.binary(max_size=200), st.integers(1, 2**32 - 1), st.integers(1, 2**32 - 1), CUTS)
def test_gzip_time_stamps_are_left_out(
    data: bytes, first: int, second: int, cuts: list[int]
) -> None:
    one = fed(GzipDigest(), gzip.compress(data, mtime=first), cuts)
    assert one == fed(GzipDigest(), gzip.compress(data, mtime=second), [])


@given(st.binary(max_size=40), CUTS)
def test_bytes_that_are_no_gzip_are_hashed_as_they_are(data: bytes, cuts: list[int]) -> None:
    if data.startswith(b"\x1f\x8b\x08"):
        return
    assert fed(GzipDigest(), data, cuts) == hashlib.sha256(data).digest()
