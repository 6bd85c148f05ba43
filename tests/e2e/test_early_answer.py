"""An upstream that answers before it has read the whole request body, then closes (RFC 9112
§9.6): a size limit's 413, an authentication layer's 401. Closing with the body unread sends a
reset, and the proxy's write of the rest of the body fails; the answer that arrived before the
reset is still the upstream's answer, stored and replayed (SPEC §2, §7), not a reset after
sending (`unknown`, SPEC §3.2). curl and urllib3 read it the same way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from idemproxy.constants import REPLAYED_HEADER
from idemproxy.core.types import JobState
from idemproxy.store.factory import create_store
from tests.support.processes import StartProxy
from tests.support.stores import opened

# Far more than the socket buffers hold, and over the proxy's spool threshold: the body is
# still being sent, a piece at a time, when the upstream has answered and gone.
BODY = b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
ANSWERS = {
    "413": b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
    b'Content-Length: 16\r\nConnection: close\r\n\r\n{"error":"big"}\n',
    "401": b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\nContent-Length: 0\r\n\r\n",
}


@dataclass
class EarlyUpstream:
    """Reads a request's head, answers at once and closes with the body unread (a reset)."""

    answer: bytes
    heads: list[bytes] = field(default_factory=list)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(self.answer)
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@pytest.fixture(params=sorted(ANSWERS))
async def early(request: pytest.FixtureRequest) -> AsyncIterator[EarlyUpstream]:
    upstream = EarlyUpstream(ANSWERS[request.param])
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        server.close()
        await server.wait_closed()


async def test_an_answer_before_the_body_was_read_is_the_upstream_s_answer(
    start_proxy: StartProxy, sqlite_dsn: str, early: EarlyUpstream
) -> None:
    """On `idemproxy serve`, whose event loop (uvloop's) closed the connection on the failed
    write before it read the answer."""
    proxy = await start_proxy("--upstream", early.url, "--store", sqlite_dsn)
    address = ("127.0.0.1", proxy.port)
    status_line, _, rest = early.answer.partition(b"\r\n")
    first, replay = [await _post(address, "early-1") for _ in range(2)]
    assert (first.status_line, first.body) == (status_line, rest.partition(b"\r\n\r\n")[2])
    assert (replay.status_line, replay.body) == (first.status_line, first.body)
    assert REPLAYED_HEADER.lower().encode() + b": true" in replay.head.lower(), replay
    assert len(early.heads) == 1, "the retry went upstream"
    async with opened(create_store(sqlite_dsn)) as store:
        job = await store.get("anonymous", "early-1")
    assert job is not None and job.state is JobState.COMPLETED


@dataclass
class Answer:
    status_line: bytes
    head: bytes
    body: bytes


async def _post(address: tuple[str, int], key: str) -> Answer:
    """BODY with `key`, on a connection of its own: the proxy's answer as bytes."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        head = (
            f"POST /charges HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.writelines((head.encode(), BODY))
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout=30)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    return Answer(head_bytes.partition(b"\r\n")[0], head_bytes, body)
