"""SPEC §9: slow clients are cut off by configurable deadlines, and never starve the others.

The proxy runs as `idemproxy serve` runs it (AppRunner + GuardedSite, see conftest.py), on a
real socket. aiohttp has no deadline for reading a request head: `server.header_read_timeout`
(proxy/server/connection.py) is ours. Bodies have `server.body_read_timeout`; pass-through bodies
that stream are bounded by `upstream_timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time

import pytest

from idemproxy.core.types import JobState
from idemproxy.store.base import Store
from tests.support.backend import Ledger

from .conftest import ListeningProxy

HEAD = b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: slow\r\n"
QUICK = {"header_read_timeout": 0.4, "body_read_timeout": 0.4, "keepalive_timeout": 5}


class Connection:
    """A raw client connection that collects whatever the proxy sends until it closes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.received = b""
        self.opened = time.monotonic()
        self.closed_after: float | None = None
        self.closed = asyncio.ensure_future(self._collect())

    @classmethod
    async def open(cls, address: tuple[str, int]) -> Connection:
        return cls(*await asyncio.open_connection(*address))

    async def _collect(self) -> None:
        with contextlib.suppress(ConnectionError):  # a reset ends it as well as a close
            while chunk := await self.reader.read(65536):
                self.received += chunk
        self.closed_after = time.monotonic() - self.opened

    async def trickle(self, data: bytes, every: float, *, limit: float = 5.0) -> None:
        """Send `data` a byte at a time until the proxy hangs up (or `limit` seconds)."""
        for byte in (data[i : i + 1] for i in range(len(data))):
            if self.closed.done() or time.monotonic() - self.opened > limit:
                return
            with contextlib.suppress(ConnectionError):
                self.writer.write(byte)
                await self.writer.drain()
            await asyncio.wait([self.closed], timeout=every)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def result(self, timeout: float = 5.0) -> bytes:
        """Everything received once the proxy closed the connection."""
        try:
            await asyncio.wait_for(asyncio.shield(self.closed), timeout)
        finally:
            self.writer.close()
        return self.received


async def test_a_silent_connection_is_closed_without_a_word(
    listening_proxy: ListeningProxy,
) -> None:
    client = await Connection.open(await listening_proxy(server=QUICK))
    assert await client.result() == b""
    assert client.closed_after is not None and 0.3 < client.closed_after < 1.5


async def test_a_trickled_head_gets_408_and_nothing_happens(
    listening_proxy: ListeningProxy, ledger: Ledger, sqlite_jobs: Store
) -> None:
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.trickle(HEAD + b"Content-Length: 1\r\n\r\nx", every=0.05)
    answer = await client.result()
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"Idempotency-Error: request-timeout" in answer and b"Connection: close" in answer
    assert re.search(rb"\r\nDate: [A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} [\d:]{8} GMT\r\n", answer)
    assert client.closed_after is not None and client.closed_after < 1.5
    assert ledger.count() == 0
    assert await sqlite_jobs.list_jobs() == []


async def test_the_next_head_on_a_kept_alive_connection_has_the_same_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(b"GET /first HTTP/1.1\r\nHost: proxy\r\n\r\n")
    await asyncio.sleep(0.6)  # idle longer than the header deadline: keepalive's business
    began = time.monotonic()
    await client.trickle(b"GET /second HTTP/1.1\r\nHost: proxy\r\nX-Slow: 1\r\n\r\n", every=0.05)
    answer = await client.result()
    assert time.monotonic() - began < 1.5
    assert answer.startswith(b"HTTP/1.1 201 Created")
    assert answer.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 408 Request Timeout" in answer
    assert [e.path_qs for e in ledger.executions] == ["/first"]


async def test_the_next_heads_deadline_counts_from_its_own_first_byte(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """The connection's one timer was set for the first head's deadline (0.4 s after it
    opened); a second head that starts 0.25 s in is due 0.4 s after its own first byte, so that
    timer must neither cut it early nor let it run on."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(b"GET /first HTTP/1.1\r\nHost: proxy\r\n\r\n")
    await asyncio.sleep(0.25 - (time.monotonic() - client.opened))
    began = time.monotonic()
    await client.trickle(b"GET /second HTTP/1.1\r\nHost: proxy\r\nX-Slow: 1\r\n\r\n", every=0.05)
    answer = await client.result()
    assert client.closed_after is not None
    cut_after = client.closed_after - (began - client.opened)
    assert 0.35 < cut_after < 1.0
    assert answer.startswith(b"HTTP/1.1 201 Created")
    assert b"HTTP/1.1 408 Request Timeout" in answer
    assert [e.path_qs for e in ledger.executions] == ["/first"]


async def test_a_next_head_begun_while_a_request_is_served_owes_the_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """The start of a pipelined head that arrives with the end of a body, then nothing more:
    its deadline runs from the response on, not until `keepalive_timeout` (5 s here)."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(b"POST /first HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n\r\n{")
    await asyncio.sleep(0.1)  # the request is being served, its body half read
    await client.send(b"}GET /second HTTP/1.1\r\nHost: proxy\r\n")
    answer = await client.result(timeout=3.0)
    assert answer.startswith(b"HTTP/1.1 201 Created")
    assert b"HTTP/1.1 408 Request Timeout" in answer
    assert client.closed_after is not None and client.closed_after < 2.0
    assert [e.path_qs for e in ledger.executions] == ["/first"]


async def test_a_head_begun_after_a_pipelined_request_owes_the_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """While a request is served: the end of its body, a whole next request, and the start of
    a third head, then nothing more. The third head's deadline runs from the second's
    response on, not until `keepalive_timeout` (5 s here)."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(b"POST /first HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n\r\n{")
    await asyncio.sleep(0.1)  # the request is being served, its body half read
    await client.send(
        b"}GET /second HTTP/1.1\r\nHost: proxy\r\n\r\nPOST /third HTTP/1.1\r\nHost: proxy\r\n"
    )
    answer = await client.result(timeout=4.0)
    assert answer.startswith(b"HTTP/1.1 201 Created")
    assert answer.count(b"HTTP/1.1 201 Created") == 2
    assert b"HTTP/1.1 408 Request Timeout" in answer
    assert client.closed_after is not None and client.closed_after < 2.0
    assert [e.path_qs for e in ledger.executions] == ["/first", "/second"]


async def test_an_idle_connection_after_a_chunked_upload_owes_no_head_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """A chunked body whose end comes in a later read than its head: the framing makes the
    read longer than the body, but no next head began. Idle time is keepalive_timeout's
    business (5 s here), never a 408 that the client would read as its next request's answer."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(
        b"POST /first HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}"
    )
    await asyncio.sleep(0.1)
    await client.send(b"\r\n0\r\n\r\n")
    await asyncio.sleep(0.8)  # idle, twice the head deadline
    await client.send(b"GET /second HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n")
    answer = await client.result(timeout=4.0)
    assert answer.count(b"HTTP/1.1 201 Created") == 2, answer[:300]
    assert b"408 Request Timeout" not in answer
    assert [e.path_qs for e in ledger.executions] == ["/first", "/second"]


CHUNKED = b"POST /first HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "first",
    [
        CHUNKED + b"2\r\n{}\r\n0\r\n\r\n",
        CHUNKED + b"1;ext=1\r\n{\r\n1\r\n}\r\n0\r\nX-Trailer: 1\r\n\r\n",
        CHUNKED + b"2\r\n{}\r\n0\r\n\r\nGET /whole HTTP/1.1\r\nHost: proxy\r\n\r\n",
    ],
    ids=["chunked", "chunks with an extension and a trailer", "a whole request between"],
)
async def test_a_next_head_begun_in_the_read_of_a_chunked_request_owes_the_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger, first: bytes
) -> None:
    """As after a framed body: the chunks are walked to where the next head begins."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(first + b"GET /partial HTTP/1.1\r\nX-A: ")
    answer = await client.result(timeout=4.0)
    whole = first.count(b"HTTP/1.1\r\n")
    assert answer.count(b"HTTP/1.1 201 Created") == whole, answer[:300]
    assert b"HTTP/1.1 408 Request Timeout" in answer
    assert client.closed_after is not None and client.closed_after < 2.0
    assert len(ledger.executions) == whole


async def test_a_head_behind_chunks_that_end_in_a_later_read_owes_the_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """The chunked request's head alone in one read; its chunks, a whole request and the start
    of a third head in the next: the chunks are followed into that read."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(CHUNKED)
    await asyncio.sleep(0.1)
    await client.send(
        b"3\r\nabc\r\n0\r\n\r\nGET /b HTTP/1.1\r\nHost: proxy\r\n\r\nGET /st HTTP/1.1\r\nHo"
    )
    answer = await client.result(timeout=4.0)
    assert answer.count(b"HTTP/1.1 201 Created") == 2, answer[:300]
    assert b"HTTP/1.1 408 Request Timeout" in answer
    assert client.closed_after is not None and client.closed_after < 2.5


@pytest.mark.parametrize(
    "first",
    [
        CHUNKED + b"2\r\n{}\r\n0\r\n\r\n",
        b"POST /first HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /first HTTP/1.1\r\nHost: proxy\r\n\r\n",
    ],
    ids=["chunked", "a body", "no body"],
)
async def test_an_empty_line_after_a_request_begins_no_head(
    listening_proxy: ListeningProxy, ledger: Ledger, first: bytes
) -> None:
    """RFC 9112 §2.2: empty lines before a request line are ignored. A CRLF a client sends
    after its request owes no deadline: no 408 that it would read as its next answer."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(first + b"\r\n")
    await asyncio.sleep(0.3)
    await client.send(b"\r\n")
    await asyncio.sleep(0.8)  # twice the head deadline
    await client.send(b"GET /second HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n")
    answer = await client.result(timeout=4.0)
    assert answer.count(b"HTTP/1.1 201 Created") == 2, answer[:300]
    assert b"408 Request Timeout" not in answer


@pytest.mark.parametrize(
    "read",
    [
        b"\r\n\r\n" + b"POST /first HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /first HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n\r\n{}\r\n\r\n"
        b"GET /between HTTP/1.1\r\nHost: proxy\r\n\r\n",
    ],
    ids=["before the request", "between two requests"],
)
async def test_empty_lines_in_the_read_of_a_request_begin_no_head(
    listening_proxy: ListeningProxy, ledger: Ledger, read: bytes
) -> None:
    """RFC 9112 §2.2: empty lines before a request line are ignored, in the same read as the
    request too. Their blank line was taken for the end of its head, and the request's own
    head for a next one: an idle client got a 408 it read as its next answer."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(read)
    await asyncio.sleep(0.8)  # idle, twice the head deadline
    await client.send(b"GET /last HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n")
    answer = await client.result(timeout=4.0)
    assert b"408 Request Timeout" not in answer, answer[:400]
    assert answer.count(b"HTTP/1.1 201 Created") == read.count(b" HTTP/1.1\r\n") + 1


async def test_a_head_behind_empty_lines_and_a_chunked_request_owes_the_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """A request, empty lines, a chunked request and the start of a head, in one read: the
    chunked request's head is found behind the empty lines, its chunks followed, and the head
    begun after them owes the deadline (it was held until keepalive_timeout)."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    first = b"POST /first HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n\r\n{}"
    await client.send(
        first + b"\r\n\r\n" + CHUNKED.replace(b"/first", b"/second") + b"2\r\n{}\r\n0\r\n\r\n"
        b"GET /partial HTTP/1.1\r\nX-A: "
    )
    answer = await client.result(timeout=4.0)
    assert answer.count(b"HTTP/1.1 201 Created") == 2, answer[:300]
    assert b"HTTP/1.1 408 Request Timeout" in answer
    assert client.closed_after is not None and client.closed_after < 2.5


@pytest.mark.parametrize(
    "ending",
    [
        (b"3\r\nabc\r\n0\r\n\r", b"\n"),
        (b"3\r\nabc\r\n0\r\n", b"\r", b"\n"),
        (b"3\r\nabc\r\n0\r\n\r\n\n",),
    ],
    ids=["in two reads", "in three reads", "then an empty line"],
)
async def test_a_chunked_body_whose_blank_line_a_read_cut_owes_no_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger, ending: tuple[bytes, ...]
) -> None:
    """A head cut across reads (its chunks are then not followed), and the body's last blank
    line cut between two reads: its last read, `\\n`, looked like bytes of a next head."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    for piece in (CHUNKED[:-10], CHUNKED[-10:], *ending):
        await client.send(piece)
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.8)  # idle, twice the head deadline
    await client.send(b"GET /last HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n")
    answer = await client.result(timeout=4.0)
    assert b"408 Request Timeout" not in answer, answer[:400]
    assert answer.count(b"HTTP/1.1 201 Created") == 2


async def test_a_head_begun_later_behind_a_chunked_request_and_a_queued_one_owes_the_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """A chunked request to a slow upstream and a whole request in one read; while the first is
    served, the start of a third head in a later read, then nothing more."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    slow = CHUNKED.replace(b"/first", b"/first?delay=0.5")
    await client.send(slow + b"2\r\n{}\r\n0\r\n\r\nGET /whole HTTP/1.1\r\nHost: proxy\r\n\r\n")
    await asyncio.sleep(0.1)
    await client.send(b"GET /third HTTP/1.1\r\nHo")
    answer = await client.result(timeout=4.0)
    assert answer.count(b"HTTP/1.1 201 Created") == 2, answer[:300]
    assert b"HTTP/1.1 408 Request Timeout" in answer
    assert client.closed_after is not None and client.closed_after < 2.5


@pytest.mark.parametrize(
    "after",
    [
        # A whole request queued from the first read, then a partial head in a second one.
        (
            b"GET /first?delay=0.5 HTTP/1.1\r\nHost: proxy\r\n\r\n"
            b"GET /whole HTTP/1.1\r\nHost: proxy\r\n\r\n",
            b"GET /third HTTP/1.1\r\nHo",
        ),
        # A governed POST refused before its body (a key too long), whose body arrives with the
        # start of a next head: aiohttp drains the body, the head owes the deadline.
        (
            b"POST /first HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: "
            + b"k" * 300
            + b"\r\nContent-Length: 10\r\n\r\n",
            b"0123456789GET /third HTTP/1.1\r\nHo",
        ),
    ],
    ids=["queued from an earlier read", "after a drained body"],
)
async def test_a_head_begun_in_a_later_read_owes_the_deadline(
    listening_proxy: ListeningProxy, after: tuple[bytes, bytes]
) -> None:
    first, later = after
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(first)
    await asyncio.sleep(0.1)
    await client.send(later)
    answer = await client.result(timeout=4.0)
    assert b"HTTP/1.1 408 Request Timeout" in answer, answer[:300]
    assert client.closed_after is not None and client.closed_after < 2.5


async def test_bytes_after_an_upgrade_request_are_no_head_owing_a_deadline(
    listening_proxy: ListeningProxy,
) -> None:
    """aiohttp hands what follows an upgrade request to that request: no 408 for it."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(
        b"GET /u HTTP/1.1\r\nHost: proxy\r\nConnection: Upgrade\r\nUpgrade: foo\r\n\r\n"
        b"GET /v HTTP/1.1\r\nHost: proxy\r\n\r\n"
    )
    await asyncio.sleep(1.0)  # past the head deadline
    assert b"408 Request Timeout" not in client.received
    client.writer.close()


@pytest.mark.parametrize(
    "first",
    [
        b"GET /first HTTP/1.1\r\nHost: proxy\r\n\r\n",
        b"POST /first HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /first HTTP/1.1\r\nHost: proxy\r\n\r\nGET /whole HTTP/1.1\r\nHost: proxy\r\n\r\n",
    ],
    ids=["no body", "a body", "a whole request between"],
)
async def test_a_next_head_begun_in_the_same_read_owes_the_deadline(
    listening_proxy: ListeningProxy, ledger: Ledger, first: bytes
) -> None:
    """The start of a next head in the very read that brought the request(s) before it, then
    nothing more: its deadline runs from the last response on, not until `keepalive_timeout`
    (5 s here)."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(first + b"POST /second HTTP/1.1\r\n")
    answer = await client.result(timeout=4.0)
    whole = first.count(b"HTTP/1.1\r\n")
    assert answer.startswith(b"HTTP/1.1 201 Created")
    assert answer.count(b"HTTP/1.1 201 Created") == whole
    assert b"HTTP/1.1 408 Request Timeout" in answer
    assert client.closed_after is not None and client.closed_after < 2.0
    assert len(ledger.executions) == whole and b"/second" not in answer


async def test_the_head_deadline_never_cuts_a_slow_upstream_or_a_body_in_time(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    address = await listening_proxy(server={**QUICK, "body_read_timeout": 3.0})
    slow_upstream = await Connection.open(address)  # the backend takes 0.8 s to answer
    await slow_upstream.send(
        b"POST /pay?delay=0.8 HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: slow\r\n"
        b"Content-Length: 1\r\nConnection: close\r\n\r\nx"
    )
    slow_body = await Connection.open(address)  # the body takes about 1 s to arrive
    await slow_body.send(
        b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: slow-2\r\n"
        b"Content-Length: 12\r\nConnection: close\r\n\r\n"
    )
    await slow_body.trickle(b"twelve bytes", every=0.08)
    for client in (slow_upstream, slow_body):
        assert (await client.result()).startswith(b"HTTP/1.1 201 Created")
    assert ledger.count("slow") == ledger.count("slow-2") == 1


async def test_a_drip_fed_governed_body_is_408_before_any_claim(
    listening_proxy: ListeningProxy, ledger: Ledger, sqlite_jobs: Store
) -> None:
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(HEAD + b"Content-Length: 100\r\n\r\n")
    await client.trickle(b"x" * 100, every=0.05, limit=1.5)
    answer = await client.result()
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout")
    assert b"Idempotency-Error: request-timeout" in answer
    assert ledger.count() == 0
    assert await sqlite_jobs.list_jobs() == []


async def test_a_drip_fed_small_pass_through_body_is_408(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """Found here: pass-through bodies up to 64 KiB were read with no deadline at all."""
    client = await Connection.open(await listening_proxy(server=QUICK))
    await client.send(b"PUT /doc HTTP/1.1\r\nHost: proxy\r\nContent-Length: 100\r\n\r\n")
    began = time.monotonic()
    await client.trickle(b"x" * 100, every=0.05, limit=1.5)
    answer = await client.result()
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout")
    assert time.monotonic() - began < 1.5
    assert ledger.count() == 0


async def test_a_drip_fed_streamed_pass_through_body_is_bounded_by_upstream_timeout(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    """A streamed body has no deadline of its own: upstream_timeout (the whole exchange) cuts
    it off with 504. aiohttp then lingers up to 10 s over the unread body before closing."""
    client = await Connection.open(await listening_proxy(server=QUICK, upstream_timeout=0.6))
    await client.send(b"PUT /doc HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: chunked\r\n\r\n")
    began = time.monotonic()
    while b"\r\n\r\n" not in client.received and time.monotonic() - began < 2.5:
        await client.trickle(b"1\r\nx\r\n", every=0.05)
    assert client.received.startswith(b"HTTP/1.1 504 Gateway Timeout")
    assert time.monotonic() - began < 1.5
    client.writer.close()
    assert ledger.count() == 0  # the backend never got a whole request


async def test_fifty_slowloris_connections_do_not_starve_a_normal_request(
    listening_proxy: ListeningProxy, ledger: Ledger
) -> None:
    address = await listening_proxy(server={"header_read_timeout": 2, "body_read_timeout": 2})
    loris = [await Connection.open(address) for _ in range(50)]
    drips = [
        client.trickle(HEAD + b"X-Slow: " + b"z" * 200, every=0.05)
        if index % 2
        else _drip_body(client, index)
        for index, client in enumerate(loris)
    ]
    dripping = asyncio.gather(*drips)
    await asyncio.sleep(0.3)  # all fifty are mid-request now
    began = time.monotonic()
    normal = await Connection.open(address)
    await normal.send(
        b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: normal\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\nok"
    )
    assert (await normal.result()).startswith(b"HTTP/1.1 201 Created")
    assert time.monotonic() - began < 1.0  # the deadlines are 2 s: none was cut off yet
    assert not any(client.closed.done() for client in loris)  # they were all still open
    await dripping
    answers = [await client.result() for client in loris]
    assert all(a.startswith(b"HTTP/1.1 408 Request Timeout") for a in answers), set(answers)
    assert all(c.closed_after is not None and c.closed_after < 3.5 for c in loris)
    assert [e.header("Idempotency-Key") for e in ledger.executions] == ["normal"]


async def _drip_body(client: Connection, index: int) -> None:
    head = f"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: drip-{index}\r\n"
    await client.send(head.encode() + b"Content-Length: 1000\r\n\r\n")
    await client.trickle(b"y" * 1000, every=0.05)


async def test_a_slow_reader_of_a_streamed_response_does_not_make_its_job_unknown(
    listening_proxy: ListeningProxy, sqlite_jobs: Store, ledger: Ledger
) -> None:
    address = await listening_proxy(max_stored_body=1000, upstream_timeout=1.0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, address)
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(
        b"POST /export?size=12000000 HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: slow-reader\r\n"
        b"Content-Length: 1\r\nConnection: close\r\n\r\nx"
    )
    await writer.drain()
    await asyncio.sleep(2.5)  # reads nothing for a while: a phone on a bad network
    with contextlib.suppress(ConnectionError):
        while await reader.read(1 << 20):
            pass
    writer.close()
    assert ledger.count("slow-reader") == 1
    (job,) = await sqlite_jobs.list_jobs()
    assert job.state is JobState.COMPLETED  # the upstream answered in full and in time
