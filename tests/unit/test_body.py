"""Reading a governed body (SPEC §2.1, §9): whole or still arriving, the same limits apply."""

from __future__ import annotations

import asyncio
import hashlib
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from idemproxy.errors import BodyTooLarge, RequestTimeout
from idemproxy.proxy.server.connection import RequestBody, read_body

BODY = b'{"amount":1250,"currency":"EUR","note":"bench"}'


def _request(chunks: list[bytes], *, eof: bool, declared: int | None) -> web.Request:
    protocol = mock.Mock(_reading_paused=False)
    stream = StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())
    for chunk in chunks:
        stream.feed_data(chunk)
    if eof:
        stream.feed_eof()
    headers = {} if declared is None else {"Content-Length": str(declared)}
    return make_mocked_request("POST", "/p", headers=headers, payload=stream)


async def _read(request: web.Request, *, limit: int = 1000, spool: int = 100) -> RequestBody:
    return await read_body(request, limit=limit, timeout=0.2, spool_threshold=spool)


async def _bytes_of(body: RequestBody) -> bytes:
    if body.memory is not None:
        return body.memory
    return b"".join([chunk async for chunk in body.reader()])


@pytest.mark.parametrize("declared", [len(BODY), None], ids=["content-length", "chunked"])
async def test_a_body_already_buffered_is_read_whole_into_memory(declared: int | None) -> None:
    body = await _read(_request([BODY[:10], BODY[10:]], eof=True, declared=declared))
    assert not body.spooled and body.memory == BODY and body.size == len(BODY)


async def test_a_body_still_arriving_is_read_as_it_comes() -> None:
    request = _request([BODY[:10]], eof=False, declared=len(BODY))
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, request.content.feed_data, BODY[10:])
    loop.call_later(0.02, request.content.feed_eof)
    body = await _read(request)
    assert not body.spooled and body.memory == BODY


@pytest.mark.parametrize("eof", [True, False], ids=["buffered", "arriving"])
async def test_a_body_over_the_spool_threshold_goes_to_disk(eof: bool) -> None:
    data = bytes(range(256)) * 2
    request = _request([data[:300], data[300:]], eof=eof, declared=None)
    if not eof:
        asyncio.get_running_loop().call_later(0.01, request.content.feed_eof)
    body = await _read(request, spool=256)
    assert body.spooled and body.size == len(data)
    assert body.memory is None  # never taken for an empty body
    with pytest.raises(ValueError):
        body.held()
    assert body.raw_sha256 == hashlib.sha256(data).digest()
    assert await _bytes_of(body) == data


@pytest.mark.parametrize("eof", [True, False], ids=["buffered", "arriving"])
async def test_an_undeclared_body_over_the_limit_is_413(eof: bool) -> None:
    request = _request([b"x" * 600, b"y" * 600], eof=eof, declared=None)
    with pytest.raises(BodyTooLarge):
        await _read(request, limit=1000)


async def test_a_declared_length_over_the_limit_is_413_before_reading() -> None:
    with pytest.raises(BodyTooLarge):
        await _read(_request([], eof=False, declared=1001), limit=1000)


async def test_a_drip_fed_body_is_408() -> None:
    request = _request([BODY[:10]], eof=False, declared=len(BODY))
    with pytest.raises(RequestTimeout):
        await _read(request)


async def test_no_body_is_an_empty_one() -> None:
    body = await _read(make_mocked_request("POST", "/p"))
    assert not body.spooled and body.memory == b"" and body.size == 0
