"""Stored header pairs (store/rows.py) and heads for the client (proxy/server/connection.py): every
byte an upstream's header value may hold survives storing and sending (SPEC §7)."""

from __future__ import annotations

import json

import pytest
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict

from idemproxy.core.types import StoredResponse
from idemproxy.http.headers import PROXY_OWNED, REASON_FIELD, headers_to_store, stored_reason
from idemproxy.ops.table import _response_details
from idemproxy.ops.view import response_to_json
from idemproxy.proxy.server.connection import serialise_head
from idemproxy.store.rows import decode_headers, encode_headers, pairs_from_json, pairs_to_json

# What proxy/upstream/client.py makes of each byte an upstream's header value may hold (all but
# NUL, CR, LF and the other control characters, which never get that far).
EVERY_BYTE = bytes([0x09, *range(0x20, 0x7F), *range(0x80, 0x100)])
AS_PARSED = EVERY_BYTE.decode("utf-8", "surrogateescape")
PAIRS = (
    ("Content-Type", "text/plain"),
    ("X-Name", b"caf\xe9".decode("utf-8", "surrogateescape")),
    ("X-Utf8", "naïve ☃ 😀"),
    ("X-Every", AS_PARSED),
)


def test_each_pair_survives_the_json_round_trip() -> None:
    encoded = json.dumps(pairs_to_json(PAIRS))
    assert encoded.isascii()
    assert "\\udc" not in encoded.lower()  # no lone surrogate: PostgreSQL's jsonb takes it
    assert pairs_from_json(json.loads(encoded)) == PAIRS
    assert decode_headers(encode_headers(PAIRS)) == PAIRS


def test_only_pairs_that_are_not_utf8_are_marked() -> None:
    assert pairs_to_json(PAIRS)[:3] == [
        ["Content-Type", "text/plain"],
        ["X-Name", "caf\xe9", "latin-1"],  # the bytes read as ISO-8859-1
        ["X-Utf8", "naïve ☃ 😀"],
    ]


def test_an_ascii_list_is_kept_pair_for_pair() -> None:
    assert pairs_to_json((("Content-Type", "text/plain"), ("X-A", ""))) == [
        ["Content-Type", "text/plain"],
        ["X-A", ""],
    ]
    assert pairs_to_json(()) == []
    # One pair that is not UTF-8, after ASCII ones, is still marked.
    assert pairs_to_json((("X-A", "1"), ("X-B", "\udce9")))[1] == ["X-B", "\xe9", "latin-1"]


def test_pairs_stored_before_read_as_before() -> None:
    assert decode_headers('[["X-A","1"],["X-B","é"]]') == (("X-A", "1"), ("X-B", "é"))


@pytest.mark.parametrize("pair", [["a", "b", "utf-16"], ["a"], ["a", "b", "latin-1", "x"]])
def test_an_unknown_pair_form_is_an_error(pair: list[str]) -> None:
    with pytest.raises(ValueError):
        pairs_from_json([pair])


def test_an_ascii_head_is_what_aiohttp_makes() -> None:
    headers = CIMultiDict([("Content-Type", "text/plain"), ("X-A", "1\t2"), ("X-A", "3")])
    assert serialise_head("HTTP/1.1 200 OK", headers) == _serialize_headers(
        "HTTP/1.1 200 OK", headers
    )


def test_a_head_sends_every_value_byte_as_parsed() -> None:
    headers = CIMultiDict(PAIRS)
    reason = b"Tr\xe8s bien".decode("utf-8", "surrogateescape")
    head = serialise_head(f"HTTP/1.1 200 {reason}", headers)
    assert head == (
        b"HTTP/1.1 200 Tr\xe8s bien\r\nContent-Type: text/plain\r\nX-Name: caf\xe9\r\n"
        + "X-Utf8: naïve ☃ 😀\r\n".encode()
        + b"X-Every: "
        + EVERY_BYTE
        + b"\r\n\r\n"
    )


@pytest.mark.parametrize("bad", ["a\r\nX-Injected: 1", "a\nb", "a\x00b", "a\x01b", "a\x7fb"])
def test_a_head_refuses_a_control_character_as_aiohttp_does(bad: str) -> None:
    headers = CIMultiDict([("X-Name", "caf\udce9"), ("X-Bad", bad)])
    with pytest.raises(ValueError, match="Forbidden control character"):
        serialise_head("HTTP/1.1 200 OK", headers)
    with pytest.raises(ValueError, match="Forbidden control character"):
        serialise_head(f"HTTP/1.1 200 {bad}", CIMultiDict([("X-Name", "caf\udce9")]))


@pytest.mark.parametrize("bad", ["a\r\nX-Injected: 1", "a\nb", "a\rb"])
def test_an_ascii_head_refuses_a_line_break_as_aiohttp_does(bad: str) -> None:
    with pytest.raises(ValueError, match="Forbidden control character"):
        serialise_head("HTTP/1.1 200 OK", CIMultiDict([("X-Bad", bad)]))
    with pytest.raises(ValueError, match="Forbidden control character"):
        serialise_head(f"HTTP/1.1 200 {bad}", CIMultiDict([("X-Name", "value")]))


def test_the_jobs_views_show_such_a_header_as_json_can_carry_it() -> None:
    response = StoredResponse(200, PAIRS[:2], b"ok")
    view = response_to_json(response)
    assert view is not None
    text = json.dumps(view)
    assert "\\udc" not in text.lower()
    assert view["headers"][1] == ["X-Name", "caf\xe9", "latin-1"]
    assert "  X-Name: caf\xe9" in _response_details(view)


@pytest.mark.parametrize(
    ("reason", "shown"),
    [
        ("Made", {"reason": "Made"}),
        ("", {"reason": ""}),
        ("Créé", {"reason": "Créé"}),
        (
            b"Tr\xe8s".decode("utf-8", "surrogateescape"),
            {"reason": "Tr\xe8s", "reason_encoding": "latin-1"},
        ),
    ],
)
def test_a_stored_reason_phrase_is_shown_apart_from_the_headers(
    reason: str, shown: dict[str, str]
) -> None:
    """SPEC §7: the phrase is kept ahead of the headers; operators see it as its own field."""
    stored = StoredResponse(201, (("Idempotent-Replayed", reason), ("X-A", "1")), b"ok")
    view = response_to_json(stored)
    assert view is not None
    assert {name: view[name] for name in shown} == shown
    assert view["headers"] == [["X-A", "1"]]
    assert _response_details(view)[0] == f"  (reason phrase: {shown['reason']})"
    plain = response_to_json(StoredResponse(201, (("X-A", "1"),), b"ok"))
    assert plain is not None and "reason" not in plain


def test_a_stored_reason_phrase_that_no_status_line_may_carry_is_not_replayed() -> None:
    """A phrase with a line break or another control character (which the proxy never stores:
    a row written by someone else) is replayed as the standard phrase, never as a head split."""
    assert stored_reason((("Idempotent-Replayed", "Made"), ("X-A", "1"))) == (
        "Made",
        (("X-A", "1"),),
    )
    assert stored_reason((("Idempotent-Replayed", "a\r\nX-B: 2"), ("X-A", "1"))) == (
        None,
        (("X-A", "1"),),
    )
    assert stored_reason((("Idempotent-Replayed", "a\x01"),)) == (None, ())
    assert stored_reason((("X-A", "1"),)) == (None, (("X-A", "1"),))


def test_the_reason_is_carried_under_a_name_no_upstream_s_field_is_stored_with() -> None:
    """The carrier is a field the proxy owns: never stored from an upstream (nor taken in a
    resolution), and set anew by every replay, so that a replica that predates it replays the
    standard phrase and its own mark rather than a field no client expects."""
    assert REASON_FIELD.lower() in PROXY_OWNED
    upstream = CIMultiDict([("Idempotent-Replayed", "forged"), ("X-A", "1")])
    assert headers_to_store(upstream, ()) == (("X-A", "1"),)
    assert stored_reason((("X-A", "1"), (REASON_FIELD, "late"))) == (
        None,
        (("X-A", "1"), (REASON_FIELD, "late")),
    )  # only the first pair: a stray one is replaced by the replay's own mark


def test_a_stored_reason_that_cannot_be_written_is_not_replayed() -> None:
    """A lone surrogate (a row written by hand) has no bytes to be written in."""
    assert stored_reason(((REASON_FIELD, "\ud800"),)) == (None, ())
    view = response_to_json(StoredResponse(201, ((REASON_FIELD, "\ud800"),), b"ok"))
    assert view is not None and "reason" not in view and view["headers"] == []
