"""SPEC §8, §9, §10: hostile requests that parse, against the listener `idemproxy serve` uses.

Framing errors (tests/hostile/test_framing.py) never get past the parser; these do, and must
still end in a clean 4xx or a harmless forward, with no job left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from idemproxy.core.types import JobState
from idemproxy.store.base import Store
from tests.support.backend import Ledger

from .conftest import ListeningProxy


async def exchange(address: tuple[str, int], data: bytes, *, half_close: bool = False) -> bytes:
    """Send raw bytes (then FIN, if `half_close`); all the proxy answers until it closes."""
    reader, writer = await asyncio.open_connection(*address)
    answer = b""
    try:
        writer.write(data)
        await writer.drain()
        if half_close:
            writer.write_eof()
        with contextlib.suppress(ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(65536), 5):
                answer += chunk
    finally:
        writer.close()
    return answer


async def test_expect_continue_with_an_oversize_body_gets_413_without_sending_it(
    listening_proxy: ListeningProxy, ledger: Ledger, sqlite_jobs: Store
) -> None:
    address = await listening_proxy(max_request_body=100)
    reader, writer = await asyncio.open_connection(*address)
    writer.write(
        b"POST /upload HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: big\r\n"
        b"Content-Length: 1000000\r\nExpect: 100-continue\r\n\r\n"
    )  # and never a byte of the body
    await writer.drain()
    answer = b""
    while b"Idempotency-Error: body-too-large" not in answer:
        answer += await asyncio.wait_for(reader.read(65536), 2)
    writer.close()
    assert b"HTTP/1.1 413 Request Entity Too Large\r\n" in answer
    assert ledger.count() == 0
    assert await sqlite_jobs.list_jobs() == []


async def test_expect_continue_with_an_oversize_body_is_not_invited(
    listening_proxy: ListeningProxy,
) -> None:
    address = await listening_proxy(max_request_body=100)
    reader, writer = await asyncio.open_connection(*address)
    writer.write(
        b"POST /upload HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: big\r\n"
        b"Content-Length: 1000000\r\nExpect: 100-continue\r\n\r\n"
    )
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b"\r\n"), 2)
    writer.close()
    assert first.startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize(
    ("head", "code"),
    [
        (b"Idempotency-Key: " + b"k" * 300 + b"\r\n", b"key-invalid"),
        (b"Idempotency-Key: a\r\nIdempotency-Key: b\r\n", b"key-invalid"),
        (
            b"Idempotency-Key: s3\r\nAuthorization: AWS4-HMAC-SHA256 Credential=AKID/x,"
            b" SignedHeaders=host, Signature=abc\r\n",
            b"owner-unstable",
        ),
        (b"Idempotency-Key: c1\r\nX-Api-Key: sk-alice\r\n", b"owner-missing"),
    ],
    ids=["key-too-long", "key-twice", "signed-credential", "credential-elsewhere"],
)
async def test_a_refusal_known_from_the_head_comes_before_the_body_is_invited(
    listening_proxy: ListeningProxy, ledger: Ledger, head: bytes, code: bytes
) -> None:
    """RFC 9110 §10.1.1: the client is not made to upload a body that is refused anyway."""
    address = await listening_proxy()
    reader, writer = await asyncio.open_connection(*address)
    writer.write(
        b"POST /upload HTTP/1.1\r\nHost: proxy\r\n" + head
        + b"Content-Length: 1000000\r\nExpect: 100-continue\r\n\r\n"
    )  # fmt: skip
    await writer.drain()
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += await asyncio.wait_for(reader.read(65536), 2)
    writer.close()
    assert not answer.startswith(b"HTTP/1.1 100"), answer
    assert b"Idempotency-Error: " + code in answer, answer
    assert b"Connection: close" in answer
    assert ledger.count() == 0


async def test_a_request_its_head_does_not_refuse_is_still_invited(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    address = await listening_proxy()
    reader, writer = await asyncio.open_connection(*address)
    writer.write(
        b"POST /upload HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: fine\r\n"
        b"Content-Length: 2\r\nExpect: 100-continue\r\n\r\n"
    )
    await writer.drain()
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2) == (
        b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    writer.write(b"{}")
    final = await asyncio.wait_for(reader.readuntil(b"\r\n"), 2)
    writer.close()
    assert final.startswith(b"HTTP/1.1 201"), final
    assert ledger.count("fine") == 1


@pytest.mark.parametrize("key", [True, False], ids=["governed", "pass-through"])
@pytest.mark.parametrize(
    "framing",
    [
        pytest.param(b"Content-Length: 100\r\n\r\nonly ten..", id="length"),
        pytest.param(b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", id="chunked"),
    ],
)
async def test_a_body_cut_off_by_the_client_is_never_forwarded(
    listening_proxy: ListeningProxy,
    ledger: Ledger,
    sqlite_jobs: Store,
    key: bool,
    framing: bytes,
) -> None:
    head = b"POST /pay HTTP/1.1\r\nHost: proxy\r\n" + (b"Idempotency-Key: cut\r\n" if key else b"")
    answer = await exchange(await listening_proxy(), head + framing, half_close=True)
    await asyncio.sleep(0.2)
    assert b"HTTP/1.1 2" not in answer  # nothing was answered as if it had run
    assert ledger.count() == 0  # a truncated request never reaches the backend
    assert await sqlite_jobs.list_jobs() == []


@pytest.mark.parametrize("key", ["abs-1", None], ids=["governed", "pass-through"])
async def test_absolute_form_goes_to_the_configured_upstream_path_only(
    listening_proxy: ListeningProxy, ledger: Ledger, sqlite_jobs: Store, key: str | None
) -> None:
    """Found here: `POST http://elsewhere/p` was glued to the upstream URL (500), and a governed
    one left its job claimed and never sent. RFC 9112 §3.2.2: a server must accept it. Its
    authority must name the Host's host (tests/hostile/test_forward_host.py: 400 otherwise)."""
    head = b"POST http://127.0.0.1:9/pay?x=1 HTTP/1.1\r\nHost: 127.0.0.1:9\r\nConnection: close\r\n"
    if key:
        head += f"Idempotency-Key: {key}\r\n".encode()
    answer = await exchange(await listening_proxy(), head + b"Content-Length: 2\r\n\r\nok")
    assert answer.startswith(b"HTTP/1.1 201 Created")
    assert [e.path_qs for e in ledger.executions] == ["/pay?x=1"]
    states = [job.state for job in await sqlite_jobs.list_jobs()]
    assert states == ([JobState.COMPLETED] if key else [])


@pytest.mark.parametrize("key", ["host-1", None], ids=["governed", "pass-through"])
async def test_an_invalid_host_value_gets_400_and_a_close_and_nothing_runs(
    listening_proxy: ListeningProxy, ledger: Ledger, sqlite_jobs: Store, key: str | None
) -> None:
    """RFC 9112 §3.2: `Host: a, b` (two values merged) is invalid; aiohttp's parser lets it
    through, and a request behind it on the connection must not run either."""
    head = b"POST /pay HTTP/1.1\r\nHost: a, b\r\n"
    if key:
        head += f"Idempotency-Key: {key}\r\n".encode()
    request = head + b"Content-Length: 2\r\n\r\nok" + b"GET /behind HTTP/1.1\r\nHost: p\r\n\r\n"
    answer = await exchange(await listening_proxy(), request)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"Idempotency-Error: header-invalid\r\n" in answer
    assert answer.count(b"HTTP/1.1 ") == 1  # closed after it
    assert b"a, b" not in answer  # SPEC §8: no echo
    assert ledger.count() == 0
    assert await sqlite_jobs.list_jobs() == []


async def test_http_1_0_with_transfer_encoding_closes_after_the_request(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """RFC 9112 §6.1: its framing is faulty, so nothing may follow it on the connection
    (aiohttp kept the connection open and ran a request smuggled behind it)."""
    request = (
        b"POST /pay HTTP/1.0\r\nHost: proxy\r\nConnection: keep-alive\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
        b"GET /smuggled HTTP/1.1\r\nHost: proxy\r\n\r\n"
    )
    answer = await exchange(await listening_proxy(), request)
    assert answer.count(b" 201 Created\r\n") == 1
    assert [e.path_qs for e in ledger.executions] == ["/pay"]


async def test_parser_errors_echo_nothing_and_log_no_traceback(
    listening_proxy: ListeningProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC §8: aiohttp's own 400 page quoted the offending header line back, and logged a
    traceback at ERROR for each malformed request."""
    address = await listening_proxy()
    with caplog.at_level(logging.DEBUG):
        answer = await exchange(
            address, b"POST /p HTTP/1.1\r\nHost: p\r\nX-Evil: <script>\x00\r\n\r\n"
        )
    # A header field the parser cannot read: `header-invalid` (SPEC §10), the proxy's own words.
    assert answer.startswith(b"HTTP/1.0 400 Bad Request\r\n")  # the version aiohttp hands over
    assert b"\r\nIdempotency-Error: header-invalid\r\n" in answer
    assert b"script" not in answer and b"X-Evil" not in answer
    malformed_line = await exchange(address, b"P<ST /p HTTP/1.1\r\nHost: p\r\n\r\n")
    assert malformed_line.endswith(b"\r\n\r\n400 Bad Request\n")  # not a header: plain
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def test_the_listener_applies_the_size_settings(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """GuardedSite builds handlers itself: the header limits must still be the settings'."""
    address = await listening_proxy(server={"max_field_size": 200, "max_headers": 5})
    long_field = b"GET /a HTTP/1.1\r\nHost: p\r\nX-Long: " + b"v" * 300 + b"\r\n\r\n"
    many = b"GET /b HTTP/1.1\r\nHost: p\r\n" + b"X-H: v\r\n" * 6 + b"\r\n"
    within = b"GET /c HTTP/1.1\r\nHost: p\r\nX-Ok: " + b"v" * 150 + b"\r\nConnection: close\r\n\r\n"
    assert (await exchange(address, long_field)).startswith(b"HTTP/1.0 400")
    assert (await exchange(address, many)).startswith(b"HTTP/1.0 400")
    assert (await exchange(address, within)).startswith(b"HTTP/1.1 201")
    assert [e.path_qs for e in ledger.executions] == ["/c"]
