"""SPEC §6 over raw sockets: the fingerprint of what a client may legally send.

A `Content-Type` with a byte that is not UTF-8 (obs-text, RFC 9110 §5.5) used to end in a 500
and a traceback per request; JSON bodies that differ only in a number token's text or in a
repeated member name used to fingerprint the same, so the second was replayed the first's
answer instead of being refused.
"""

from __future__ import annotations

import gzip
import logging

import pytest

from idemproxy.store.base import Store
from tests.support.backend import Ledger

from .conftest import CountingStore, ListeningProxy
from .test_requests import exchange


def request(key: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"POST /pay HTTP/1.1\r\nHost: p\r\nConnection: close\r\n"
        b"Idempotency-Key: " + key.encode() + b"\r\n"
        b"Content-Type: " + content_type + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_a_content_type_byte_that_is_not_utf8_is_fingerprinted_not_a_500(
    listening_proxy: ListeningProxy,
    ledger: Ledger,
    sqlite_jobs: Store,
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = await listening_proxy()
    with caplog.at_level(logging.WARNING):
        first = await exchange(address, request("odd-type", b"{}", b"application/j\xffson"))
        again = await exchange(address, request("odd-type", b"{}", b"application/j\xffson"))
        other = await exchange(address, request("odd-type", b"{}", b"application/j\xfeson"))
    assert status_of(first) == 201, first[:200]
    assert status_of(again) == 201 and b"Idempotent-Replayed: true\r\n" in again
    assert status_of(other) == 409 and b"Idempotency-Error: payload-mismatch\r\n" in other
    assert ledger.count("odd-type") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param(b'{"amount":0.3}', b'{"amount":0.30000000000000000001}', id="digits"),
        pytest.param(b'{"amount":1e400}', b'{"amount":9e999}', id="overflow"),
        pytest.param(b'{"to":"mallory"}', b'{"to":"alice","to":"mallory"}', id="duplicate"),
    ],
)
async def test_a_changed_number_token_or_a_repeated_name_is_a_payload_mismatch(
    listening_proxy: ListeningProxy,
    ledger: Ledger,
    sqlite_jobs: Store,
    first: bytes,
    second: bytes,
) -> None:
    address = await listening_proxy()
    assert status_of(await exchange(address, request("tokens", first))) == 201
    changed = await exchange(address, request("tokens", second))
    assert status_of(changed) == 409 and b"Idempotency-Error: payload-mismatch\r\n" in changed
    # The same bytes again are the same intent: replayed, never executed twice.
    same = await exchange(address, request("tokens", first))
    assert status_of(same) == 201 and b"Idempotent-Replayed: true\r\n" in same
    assert ledger.count("tokens") == 1


# The same bytes are the form amount=1 with boundary=c and amount=1000000 with boundary=d: the
# media type's parameters are part of the intent (SPEC §6, RFC 9110 §8.3.1).
FORM = (
    b'--c--\r\nContent-Disposition: form-data; name="amount"\r\n\r\n1\r\n--c--\r\n'
    b'--d--\r\nContent-Disposition: form-data; name="amount"\r\n\r\n1000000\r\n--d----\r\n'
)


@pytest.mark.parametrize("spool_threshold", [1024 * 1024, 16], ids=["memory", "spooled"])
async def test_another_boundary_is_a_payload_mismatch(
    listening_proxy: ListeningProxy, ledger: Ledger, sqlite_jobs: Store, spool_threshold: int
) -> None:
    address = await listening_proxy(server={"spool_threshold": spool_threshold})
    first = await exchange(address, request("form", FORM, b"multipart/form-data; boundary=c"))
    assert status_of(first) == 201, first[:200]
    other = await exchange(address, request("form", FORM, b"multipart/form-data; boundary=d"))
    assert status_of(other) == 409 and b"Idempotency-Error: payload-mismatch\r\n" in other
    # The same parameters spelled otherwise (RFC 9110 §5.6.6) are the same intent: replayed.
    same = await exchange(address, request("form", FORM, b'Multipart/Form-Data;Boundary="c"'))
    assert status_of(same) == 201 and b"Idempotent-Replayed: true\r\n" in same
    assert ledger.count("form") == 1


async def test_another_charset_is_a_payload_mismatch(
    listening_proxy: ListeningProxy, ledger: Ledger, sqlite_jobs: Store
) -> None:
    address = await listening_proxy()
    body = "Привет".encode("koi8-r")
    first = await exchange(address, request("text", body, b"text/plain; charset=koi8-r"))
    assert status_of(first) == 201, first[:200]
    other = await exchange(address, request("text", body, b"text/plain; charset=iso-8859-1"))
    assert status_of(other) == 409 and b"Idempotency-Error: payload-mismatch\r\n" in other
    assert ledger.count("text") == 1


async def test_a_repeated_content_type_is_refused_by_the_parser(
    listening_proxy: ListeningProxy, ledger: Ledger, counting_store: CountingStore
) -> None:
    """Which of two Content-Type fields counts would be each parser's choice: the proxy's HTTP
    parser refuses the request (400) before the handler, so no fingerprint ever picks one."""
    address = await listening_proxy(inject_store=counting_store)
    twice = request("twice", FORM, b"multipart/form-data; boundary=c").replace(
        b"\r\nContent-Length:",
        b"\r\nContent-Type: multipart/form-data; boundary=d\r\nContent-Length:",
    )
    answer = await exchange(address, twice)
    assert status_of(answer) == 400, answer[:200]
    assert ledger.count() == 0
    assert counting_store.calls == []


async def test_the_same_bytes_with_another_content_coding_are_a_payload_mismatch(
    listening_proxy: ListeningProxy, ledger: Ledger, sqlite_jobs: Store
) -> None:
    """RFC 9110 §8.4: with `Content-Encoding: gzip` the backend decodes the bytes; without it
    they are the payload (an upload of a .gz file). Two intents: the second is not replayed."""
    address = await listening_proxy()
    gzipped = gzip.compress(b"amount=1000000")
    plain = request("coded", gzipped, b"application/octet-stream")
    coded = plain.replace(b"\r\nContent-Length:", b"\r\nContent-Encoding: gzip\r\nContent-Length:")
    assert status_of(await exchange(address, plain)) == 201
    other = await exchange(address, coded)
    assert status_of(other) == 409 and b"Idempotency-Error: payload-mismatch\r\n" in other
    again = await exchange(address, plain)
    assert status_of(again) == 201 and b"Idempotent-Replayed: true\r\n" in again
    assert ledger.count("coded") == 1
