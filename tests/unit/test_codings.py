"""SPEC §7: decoding a stored body for a retry costs time in proportion to its bytes.

A backend answered `Content-Encoding: gzip` with 160,000 members of gzip(b"a") (3.36 MB): each
member's decoder was handed, and copied, the whole rest of the body, so a retry without
`Accept-Encoding` took 13 s of CPU in the proxy, again on every retry."""

from __future__ import annotations

import gzip
import os
import time
import zlib
from typing import Any

import pytest

from idemproxy.http.codings import MAX_CODINGS, Budget, OverBudget, Undecodable, decode

TEXT = b"hello, replay " * 50
LIMIT = 8 * 1024 * 1024  # the default max_stored_body
TINY = gzip.compress(b"a", mtime=0)  # a member of 21 bytes
_REAL_DECOMPRESSOBJ = zlib.decompressobj


class _Counted:
    """zlib's decoder, counting the bytes it is handed (each is a byte it may copy)."""

    fed = 0

    def __init__(self, wbits: int) -> None:
        self._decoder = _REAL_DECOMPRESSOBJ(wbits)

    def decompress(self, data: Any, max_length: int = 0) -> bytes:
        _Counted.fed += len(data)
        return self._decoder.decompress(data, max_length)

    @property
    def eof(self) -> bool:
        return self._decoder.eof

    @property
    def unused_data(self) -> bytes:
        return self._decoder.unused_data


def test_many_tiny_members_are_decoded_in_linear_time(monkeypatch: pytest.MonkeyPatch) -> None:
    body = TINY * 160_000
    monkeypatch.setattr(zlib, "decompressobj", _Counted)
    _Counted.fed = 0
    assert decode(body, ["gzip"], LIMIT) == b"a" * 160_000
    # Each byte is handed to a decoder a bounded number of times (it was 80,000 times on
    # average: the rest of the body, once per member). Counted, not timed: a busy machine
    # stretches any time.
    assert _Counted.fed <= 4 * len(body)


def test_the_bytes_handed_over_grow_with_the_body_not_its_square(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(zlib, "decompressobj", _Counted)
    fed = []
    for members in (1_000, 4_000):
        _Counted.fed = 0
        decode(TINY * members, ["gzip"], LIMIT)
        fed.append(_Counted.fed)
    assert fed[1] < 5 * fed[0]  # four times the members: sixteen times the bytes before


def test_members_of_every_size_decode_whole() -> None:
    noise = os.urandom(300_000)  # incompressible: a member larger than any piece it is fed in
    parts = [TEXT[:100], b"", noise, TEXT[100:], b"z"]
    body = b"".join(gzip.compress(part, mtime=0) for part in parts)
    assert decode(body, ["gzip"], LIMIT) == b"".join(parts)


def test_deflate_decodes_in_either_form_and_in_a_chain() -> None:
    raw = zlib.compressobj(wbits=-15)
    assert decode(raw.compress(TEXT) + raw.flush(), ["deflate"], 10_000) == TEXT
    assert decode(zlib.compress(TEXT), ["deflate"], 10_000) == TEXT
    members = gzip.compress(TEXT[:7], mtime=0) + gzip.compress(TEXT[7:], mtime=0)
    chained = gzip.compress(zlib.compress(members), mtime=0)
    assert decode(chained, ["gzip", "deflate", "gzip"], 10_000) == TEXT


@pytest.mark.parametrize(
    ("body", "codings", "limit"),
    [
        pytest.param(TINY * 3 + b"junk", ["gzip"], 10_000, id="junk-after-members"),
        pytest.param(TINY * 3 + b"\0" * 8, ["gzip"], 10_000, id="zeros-after-members"),
        pytest.param(TINY * 3 + TINY[:-3], ["gzip"], 10_000, id="last-member-cut-off"),
        pytest.param(TINY * 11, ["gzip"], 10, id="members-over-the-limit-together"),
        pytest.param(zlib.compress(TEXT) + b"x", ["deflate"], 10_000, id="junk-after-deflate"),
        pytest.param(zlib.compress(TEXT), ["deflate"], len(TEXT) - 1, id="deflate-over-limit"),
    ],
)
def test_what_cannot_be_decoded_says_so(body: bytes, codings: list[str], limit: int) -> None:
    with pytest.raises(Undecodable):
        decode(body, codings, limit)


def test_a_chain_longer_than_any_server_sends_is_not_decoded() -> None:
    """Each coding of a chain may decode to as much as the limit: the chain's length bounds
    the work (a body deflated a thousand times would be decoded a thousand times over)."""
    body = TEXT
    for _ in range(MAX_CODINGS + 1):
        body = zlib.compress(body)
    assert decode(zlib.decompress(body), ["deflate"] * MAX_CODINGS, 10_000) == TEXT
    with pytest.raises(Undecodable):
        decode(body, ["deflate"] * (MAX_CODINGS + 1), 10_000)


def nested_empty_members() -> bytes:
    """The review's body: 8 MiB of empty gzip members (20 bytes each), gzipped twice over, in
    about 150 stored bytes; about 420,000 decoders at the innermost layer."""
    inner = gzip.compress(b"", mtime=0) * (LIMIT // 20)
    return gzip.compress(gzip.compress(inner, mtime=0), mtime=0)


def test_an_inner_layer_cannot_hold_more_streams_than_the_stored_bytes() -> None:
    body = nested_empty_members()
    assert len(body) < 400
    started = time.perf_counter()
    with pytest.raises(Undecodable):
        decode(body, ["gzip"] * 3, LIMIT)
    assert time.perf_counter() - started < 0.3  # 0.4 to 0.55 s of 420,000 decoders before
    # One stream per layer, as servers code, still decodes.
    assert decode(gzip.compress(zlib.compress(TEXT)), ["deflate", "gzip"], 10_000) == TEXT


@pytest.mark.parametrize("codings", [["gzip"], ["deflate"], ["gzip", "gzip"]])
def test_a_budget_stops_a_decode_that_writes_more_than_it(codings: list[str]) -> None:
    body = b"0" * 100_000
    for coding in codings:
        body = gzip.compress(body, mtime=0) if coding == "gzip" else zlib.compress(body)
    with pytest.raises(OverBudget):
        decode(body, codings, LIMIT, Budget(output=10_000, streams=64))
    assert decode(body, codings, LIMIT, Budget(output=300_000, streams=64)) == b"0" * 100_000
    # Past the limit, it is refused rather than sent elsewhere to be refused again.
    with pytest.raises(Undecodable):
        decode(body, codings, 1_000, Budget(output=300_000, streams=64))


def test_a_budget_counts_streams_that_write_nothing() -> None:
    with pytest.raises(OverBudget):
        decode(gzip.compress(b"", mtime=0) * 100, ["gzip"], LIMIT, Budget(10_000, streams=64))


def test_a_zlib_stream_that_fails_after_its_header_is_not_read_as_raw_deflate() -> None:
    """`78 01` is a valid zlib header; the stream after it is not valid zlib, but read as raw
    deflate from its first byte it decoded to other bytes than the server coded."""
    body = bytes.fromhex("7801 00FEFF 5801 0500FAFF") + b"hello"
    with pytest.raises(Undecodable):
        decode(body, ["deflate"], 10_000)
    raw = zlib.compressobj(wbits=-15)
    assert decode(raw.compress(TEXT) + raw.flush(), ["deflate"], 10_000) == TEXT
