"""An upstream's answer reaches the client with the upstream's header fields (SPEC §10).

aiohttp gives every response with a body and no `Content-Type` an `application/octet-stream`
one; the proxy relayed upstream answers through aiohttp's responses, so an answer without
`Content-Type` (RFC 9110 §8.3: the recipient may then inspect the body) gained one on the first
answer, on every replay and in pass-through. Tried on every path a response takes: whole,
large (written after its head), streamed (close-delimited and chunked), a stream of events,
over max_stored_body (not kept), replayed from the store and from a spooled file.
"""

from __future__ import annotations

import itertools

import pytest

from .conftest import ProxyFactory, RawUpstream

KEY = "Idempotency-Key"
_keys = itertools.count()
LARGE = b"x" * (200 * 1024)  # over ONE_WRITE_BODY: the body goes out after its head


def chunked(body: bytes) -> bytes:
    return b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"


ANSWERS = {
    "small": b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nfine",
    "large": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(LARGE) + LARGE,
    "chunked": b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"made"),
    "close-delimited": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil close",
}


@pytest.mark.parametrize("answer", list(ANSWERS.values()), ids=list(ANSWERS))
@pytest.mark.parametrize("max_stored_body", [1024 * 1024, 8], ids=["kept", "not-kept"])
async def test_no_content_type_is_invented(
    proxy: ProxyFactory, raw_upstream: RawUpstream, answer: bytes, max_stored_body: int
) -> None:
    raw_upstream.response = answer
    client = await proxy(upstream=raw_upstream.url, max_stored_body=max_stored_body)
    key = f"no-ct-{next(_keys)}"
    for replay in (False, True):
        async with client.post("/charge", data=b"x", headers={KEY: key}) as governed:
            assert governed.status in (200, 201)
            # A body over max_stored_body is not kept: its replay has none (SPEC §7).
            assert await governed.read() or (replay and max_stored_body == 8)
            assert "Content-Type" not in governed.headers
    async with client.get("/charge") as passed:
        assert await passed.read()
        assert "Content-Type" not in passed.headers
    assert len(raw_upstream.heads) == 2  # the replay did not go upstream


async def test_a_replay_spooled_to_disk_invents_no_content_type(
    proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    """A large stored body the response budget has no room for is answered from a file."""
    raw_upstream.response = ANSWERS["large"]
    client = await proxy(upstream=raw_upstream.url, limits={"response_buffer": 64 * 1024})
    for _ in range(2):
        async with client.post("/charge", data=b"x", headers={KEY: "spooled"}) as answer:
            assert await answer.read() == LARGE
            assert "Content-Type" not in answer.headers


async def test_the_upstreams_content_type_and_the_proxys_own_are_kept(
    proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    raw_upstream.response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    client = await proxy(upstream=raw_upstream.url)
    for _ in range(2):
        async with client.post("/charge", data=b"x", headers={KEY: "ct"}) as answer:
            assert answer.headers["Content-Type"] == "application/json"
    async with client.post("/charge", data=b"y", headers={KEY: "ct"}) as problem:
        assert problem.status == 409  # payload-mismatch
        assert problem.headers["Content-Type"].startswith("application/problem+json")
