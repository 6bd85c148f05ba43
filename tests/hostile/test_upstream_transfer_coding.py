"""RFC 9112 §6.1, §6.3: the proxy decodes one transfer coding, a single `chunked`, and relays,
stores and replays the decoded bytes as the identity body (SPEC §10).

`Transfer-Encoding: gzip, chunked` had its chunking removed and its gzip bytes relayed, stored
and replayed with a Content-Length, as if they were the identity body: the bytes' meaning
changed on the way through. Any coding the proxy does not decode (gzip, deflate, compress, an
unknown one, `identity`, a second `chunked`, `chunked` followed by another line read until the
connection closes), a Transfer-Encoding on a 1.0 response and one beside a Content-Length make
the response malformed: a 502 to the first client and, as the request was sent, the job
`unknown` (SPEC §3.2) rather than a replay of bytes the upstream did not mean.
"""

from __future__ import annotations

import asyncio
import gzip
import logging

import pytest

from tests.support.backend import Ledger
from tests.support.faultproxy import FaultProxy, replace
from tests.support.proxyapp import ProxyFactory
from tests.support.proxychecks import KEY

PAYLOAD = b'{"paid":true}'
CODED = gzip.compress(PAYLOAD)


def chunked(body: bytes) -> bytes:
    return b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"


CASES = {
    "gzip-chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n" + chunked(CODED),
    "x-gzip-chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: x-gzip, chunked\r\n\r\n"
    + chunked(CODED),
    "two-lines": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: deflate\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b"x\x9c"),
    "unknown-coding": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: frob, chunked\r\n\r\n"
    + chunked(b"ok"),
    "chunked-twice": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n"
    + chunked(chunked(b"ok")),
    "chunked-then-identity": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: identity\r\n\r\n" + chunked(b"ok"),
    "identity": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\nok",
    "gzip-close-delimited": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n" + CODED,
    "http-1.0": b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"ok"),
    "with-content-length": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 2\r\n\r\n" + chunked(b"ok"),
}


@pytest.mark.parametrize("answer", list(CASES.values()), ids=list(CASES))
async def test_a_transfer_coding_the_proxy_does_not_decode_is_refused_and_unknown(
    make_proxy: ProxyFactory,
    fault_proxy: FaultProxy,
    sqlite_dsn: str,
    ledger: Ledger,
    caplog: pytest.LogCaptureFixture,
    answer: bytes,
) -> None:
    client = await make_proxy(store=sqlite_dsn, upstream=fault_proxy.url)
    caplog.set_level(logging.WARNING)
    fault_proxy.inject(replace(answer))
    async with client.post("/pay", data=b"x", headers={KEY: "te"}) as first:
        assert first.status == 502
        assert first.headers["Idempotency-Error"] == "upstream-unavailable"
    async with client.post("/pay", data=b"x", headers={KEY: "te"}) as again:
        assert again.status == 409  # SPEC §3.2: sent, then a malformed answer: unknown
        assert again.headers["Idempotency-Error"] == "outcome-unknown"
    assert ledger.count("te") == 1
    fault_proxy.inject(replace(answer))
    async with client.get("/things") as passed:
        assert passed.status == 502
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_single_chunked_coding_is_decoded(
    make_proxy: ProxyFactory, fault_proxy: FaultProxy, sqlite_dsn: str, ledger: Ledger
) -> None:
    client = await make_proxy(store=sqlite_dsn, upstream=fault_proxy.url)
    fault_proxy.inject(
        replace(b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked \r\n\r\n" + chunked(PAYLOAD))
    )
    async with client.post("/pay", data=b"x", headers={KEY: "one"}) as first:
        assert (first.status, await first.read()) == (200, PAYLOAD)
        assert (
            "Transfer-Encoding" not in first.headers
            or first.headers["Transfer-Encoding"] == "chunked"
        )
    async with client.post("/pay", data=b"x", headers={KEY: "one"}) as replay:
        assert (replay.status, await replay.read()) == (200, PAYLOAD)
    assert ledger.count("one") == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(PAYLOAD),
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + PAYLOAD,  # ends where it closes
    ],
    ids=["chunked", "close-delimited"],
)
async def test_a_streamed_answer_without_a_length_ends_an_http_1_0_connection(
    make_proxy: ProxyFactory, fault_proxy: FaultProxy, sqlite_dsn: str, answer: bytes
) -> None:
    """RFC 9112 §6.3, §9.3: to an HTTP/1.0 client a body without Content-Length ends where the
    connection closes, keep-alive asked for or not. The connection stayed open: the answer to
    the request pipelined behind it ran into the first one's body (SPEC §8: one answer per
    request on a connection)."""
    client = await make_proxy(store=sqlite_dsn, upstream=fault_proxy.url)
    fault_proxy.inject(replace(answer))
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    try:
        writer.write(
            b"GET /things HTTP/1.0\r\nHost: p\r\nConnection: keep-alive\r\n\r\n"
            b"GET /second HTTP/1.0\r\nHost: p\r\n\r\n"
        )
        received = await asyncio.wait_for(reader.read(), 5.0)  # until the proxy closes
    finally:
        writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK\r\n") and b"Content-Length" not in head
    assert body == PAYLOAD  # and no second answer after it
