"""SPEC §7: what a replay changes for its retry, as plain code over plain data (the proxy's own
tests, tests/proxy/test_replay_fit.py, send it through every store)."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
import zlib
from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from idemproxy.core.types import StoredResponse
from idemproxy.errors import EncodingNotAcceptable
from idemproxy.http.codings import Undecodable, accepts, coding_names, decode
from idemproxy.proxy.server import fit as fit_module
from idemproxy.proxy.server.fit import Fit, fit_response, fitted, unfit
from tests.unit.test_codings import nested_empty_members

TEXT = b"hello, replay " * 50


@pytest.mark.parametrize(
    ("fields", "accepted"),
    [
        (None, False),  # no field: a replay sends no coding (SPEC §7)
        ([""], False),  # RFC 9110 §12.5.3: an empty value asks for none
        (["gzip"], True),
        (["GZIP"], True),
        (["x-gzip"], True),
        (["deflate, gzip;q=0.5"], True),
        (["gzip;q=0"], False),
        (["gzip;q=0.000"], False),
        (["*"], True),
        (["*;q=0"], False),
        (["br, *;q=0.1"], True),
        (["gzip;q=0, *"], False),  # the named coding's weight wins over `*`'s
        (["identity"], False),
        (["gzip;q=nope"], False),  # a weight that does not parse is 0: decoding is safe
        (["gzip;q=2"], False),
        (["br", "gzip"], True),  # the field sent twice
        (["gzip", "gzip;q=0"], False),  # a coding listed twice counts with its lower weight
    ],
)
def test_which_codings_a_retry_accepts(fields: list[str] | None, accepted: bool) -> None:
    assert accepts(fields, "gzip") is accepted


def test_coding_names_are_in_order_lower_case_without_identity() -> None:
    assert coding_names(["identity", "Deflate, x-gzip", " BR "]) == ["deflate", "gzip", "br"]


def test_every_coding_is_undone_last_first() -> None:
    both = gzip.compress(zlib.compress(TEXT), mtime=0)
    assert decode(both, ["deflate", "gzip"], 10_000) == TEXT


def test_a_gzip_body_of_several_members_decodes_whole() -> None:
    members = gzip.compress(TEXT[:100], mtime=0) + gzip.compress(TEXT[100:], mtime=0)
    assert decode(members, ["gzip"], 10_000) == TEXT


def test_raw_deflate_decodes_as_servers_send_it() -> None:
    raw = zlib.compressobj(wbits=-15)
    body = raw.compress(TEXT) + raw.flush()
    assert decode(body, ["deflate"], 10_000) == TEXT


@pytest.mark.parametrize(
    ("body", "codings", "limit"),
    [
        pytest.param(gzip.compress(TEXT), ["br"], 10_000, id="unknown-coding"),
        pytest.param(b"not gzip at all", ["gzip"], 10_000, id="corrupt"),
        pytest.param(gzip.compress(TEXT)[:-12], ["gzip"], 10_000, id="cut-off"),
        pytest.param(gzip.compress(TEXT), ["gzip"], len(TEXT) - 1, id="over-the-limit"),
        pytest.param(gzip.compress(TEXT) + b"junk", ["gzip"], 10_000, id="trailing-junk"),
    ],
)
def test_what_cannot_be_decoded_says_so(body: bytes, codings: list[str], limit: int) -> None:
    with pytest.raises(Undecodable):
        decode(body, codings, limit)


def headers(**fields: str) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict({k.replace("_", "-"): v for k, v in fields.items()}))


CODED = StoredResponse(
    201,
    (
        ("Content-Type", "text/plain"),
        ("Content-Encoding", "gzip"),
        ("ETag", '"v1"'),
        ("Content-Digest", "sha-256=:AAAA:"),
        ("Vary", "Accept-Encoding"),
    ),
    gzip.compress(TEXT, mtime=0),
)


def test_most_replays_go_as_stored() -> None:
    plain = StoredResponse(201, (("Content-Type", "text/plain"),), TEXT)
    assert unfit(plain, headers()) is None
    assert unfit(CODED, headers(Accept_Encoding="gzip")) is None


def test_a_coded_answer_is_decoded_with_what_described_its_bytes_dropped() -> None:
    fit = unfit(CODED, headers())
    assert fit == Fit(False, ("gzip",))
    out = fit_response(CODED, fit, 10_000)
    assert (out.status, out.body) == (201, TEXT)
    assert out.headers == (
        ("Content-Type", "text/plain"),
        ("ETag", 'W/"v1"'),
        ("Vary", "Accept-Encoding"),
    )


@pytest.mark.parametrize("body", [None, b""], ids=["omitted", "empty"])
def test_an_answer_without_bytes_loses_its_coding(body: bytes | None) -> None:
    stored = StoredResponse(204, (("Content-Encoding", "br"), ("ETag", '"e"')), body)
    out = fit_response(stored, Fit(False, ("br",)), 10_000)
    assert (out.headers, out.body) == ((("ETag", 'W/"e"'),), body)


def test_a_head_keeps_its_coding_and_the_length_a_get_had() -> None:
    """RFC 9110 §9.3.2: no content to decode; its fields describe what the GET got."""
    stored = StoredResponse(200, (("Content-Encoding", "gzip"), ("Content-Length", "512")), b"")
    assert unfit(stored, headers(), head=True) is None
    assert unfit(stored, headers()) == Fit(False, ("gzip",))


def test_a_range_of_coded_bytes_is_refused() -> None:
    ranged = StoredResponse(206, (*CODED.headers, ("Content-Range", "bytes 0-9/99")), CODED.body)
    with pytest.raises(EncodingNotAcceptable) as refused:
        fit_response(ranged, Fit(False, ("gzip",)), 10_000)
    assert "gzip" in refused.value.detail


def test_a_coding_name_that_is_no_token_is_not_echoed() -> None:
    stored = StoredResponse(200, (("Content-Encoding", "<script>"),), b"x")
    with pytest.raises(EncodingNotAcceptable) as refused:
        fit_response(stored, Fit(False, ("<script>",)), 10_000)
    assert "<script>" not in refused.value.detail and "a content coding" in refused.value.detail


GRANT = StoredResponse(
    200,
    (
        ("Access-Control-Allow-Origin", "https://a.example"),
        ("Access-Control-Allow-Credentials", "true"),
        ("Vary", "Origin"),
    ),
    b"{}",
)


@pytest.mark.parametrize(
    ("origin", "dropped"),
    [
        ("https://a.example", False),
        ("https://b.example", True),
        (None, True),
    ],
)
def test_a_cors_grant_goes_to_its_own_origin_only(origin: str | None, dropped: bool) -> None:
    fit = unfit(GRANT, headers(Origin=origin) if origin else headers())
    assert (fit is not None) is dropped
    if fit is not None:
        assert fit_response(GRANT, fit, 10_000).headers == (("Vary", "Origin"),)


def test_two_origin_fields_are_no_origin() -> None:
    two = CIMultiDictProxy(CIMultiDict([("Origin", "https://a.example")] * 2))
    assert unfit(GRANT, two) == Fit(True, ())


def test_a_grant_to_any_origin_is_kept() -> None:
    anyone = StoredResponse(200, (("Access-Control-Allow-Origin", "*"),), b"{}")
    assert unfit(anyone, headers(Origin="https://b.example")) is None


def _decodes_where(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The threads `fitted` decodes on, the last one of a decode begun again elsewhere."""
    threads: list[int] = []

    def recorded(*args: Any) -> bytes:
        threads.append(threading.get_ident())
        return decode(*args)

    monkeypatch.setattr(fit_module, "decode", recorded)
    return threads


async def _ticks_while(work: Any) -> tuple[Any, float]:
    """What `work` returns and the longest the loop went without running a 1 ms ticker."""
    longest, last, done = 0.0, time.perf_counter(), asyncio.Event()

    async def tick() -> None:
        nonlocal longest, last
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.01)
    last = time.perf_counter()
    try:
        return await work, longest
    finally:
        done.set()
        await ticker


async def test_a_decode_that_grows_past_its_stored_bytes_leaves_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The review's 150 stored bytes of `gzip, gzip, gzip` decoded on the loop, 0.4 to 0.55 s
    each (the stored size decided): now the work decides, and the decode is refused."""
    threads = _decodes_where(monkeypatch)
    coded = (("Content-Encoding", "gzip, gzip, gzip"),)
    stored = StoredResponse(201, coded, nested_empty_members())
    fit = Fit(False, ("gzip", "gzip", "gzip"))
    refused = asyncio.ensure_future(fitted(stored, fit, 8 * 1024 * 1024))
    _, longest = await _ticks_while(asyncio.wait([refused]))
    with pytest.raises(EncodingNotAcceptable):
        refused.result()
    assert threads[-1] != threading.get_ident()
    assert longest < 0.25  # generous for a busy machine; 0.4 s and more before


async def test_a_small_body_that_decodes_large_is_decoded_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = _decodes_where(monkeypatch)
    document = b"0" * (4 * 1024 * 1024)
    body = gzip.compress(gzip.compress(document, mtime=0), mtime=0)
    assert len(body) < 64 * 1024
    stored = StoredResponse(200, (("Content-Encoding", "gzip, gzip"),), body)
    answer = await fitted(stored, Fit(False, ("gzip", "gzip")), 8 * 1024 * 1024)
    assert answer.body == document and threads[-1] != threading.get_ident()
    # A light one stays on the loop: the hand-off would cost more than the decode.
    threads.clear()
    light = StoredResponse(200, (("Content-Encoding", "gzip"),), gzip.compress(TEXT))
    assert (await fitted(light, Fit(False, ("gzip",)), 10_000)).body == TEXT
    assert threads == [threading.get_ident()]
