"""A governed HEAD carries the Content-Length a GET would have (RFC 9110 §9.3.2, §8.6).

Only with `methods` including HEAD (not the default). A HEAD answer has no body, so the length
the proxy would recompute from the stored body is 0; the upstream's declared length is what the
client asked for, on the first answer and on every replay, as pass-through keeps it. Read off a
bare socket: aiohttp's client would not show a missing header from a wrong one.
"""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient

from idemproxy.constants import REPLAYED_HEADER
from tests.support.proxyapp import RawUpstream
from tests.support.rawhttp import RawConnection, RawResponse

from .conftest import ProxyFactory

_SIZE = 3_000_000


async def _head(client: TestClient[Any, Any], key: str | None) -> RawResponse:
    assert client.port is not None  # the test server is started
    connection = await RawConnection.open("127.0.0.1", client.port)
    try:
        connection.send("HEAD", f"/x?size={_SIZE}", marker="head", key=key)
        return await connection.response(method="HEAD")
    finally:
        connection.close()


def _framing(answer: RawResponse) -> tuple[list[str], list[str]]:
    return answer.headers.getall("Content-Length", []), answer.headers.getall(
        "Transfer-Encoding", []
    )


async def test_a_governed_head_and_its_replay_keep_the_upstream_length(
    proxy: ProxyFactory,
) -> None:
    client = await proxy(methods=["POST", "PATCH", "HEAD"])
    untracked = await _head(client, None)
    assert untracked.status == 201 and _framing(untracked) == ([str(_SIZE)], [])
    first = await _head(client, "head-length")
    assert first.status == 201 and REPLAYED_HEADER not in first.headers
    assert _framing(first) == ([str(_SIZE)], []), first.raw_head
    replay = await _head(client, "head-length")
    assert replay.headers.get(REPLAYED_HEADER) == "true", replay.raw_head
    assert _framing(replay) == ([str(_SIZE)], []), replay.raw_head


async def test_a_body_an_upstream_sends_after_a_head_answer_never_reaches_the_client(
    make_proxy: ProxyFactory, sqlite_dsn: str, raw_upstream: RawUpstream
) -> None:
    """RFC 9110 §9.3.2: a HEAD's answer ends with its head. An upstream that sends the body its
    Content-Length announces anyway: relayed, those bytes would be read as the start of the
    client's next answer on the connection."""
    raw_upstream.response = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    client = await make_proxy(upstream=raw_upstream.url, store=sqlite_dsn)
    assert client.port is not None
    connection = await RawConnection.open("127.0.0.1", client.port)
    try:
        connection.send("HEAD", "/x", marker="head-with-body")
        answer = await connection.response(method="HEAD")
        assert (answer.status, answer.headers.getall("Content-Length")) == (200, ["5"])
        assert await connection.quiet() == b""  # nothing after the head
        connection.send("GET", "/y", marker="after-head")
        after = await connection.response(method="GET")
        assert (after.status, after.body) == (200, b"hello")
    finally:
        connection.close()
