"""proxy/server/connection.py: a complete response's bytes, the same as aiohttp's own path
writes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import pytest
from aiohttp import HttpVersion, HttpVersion10, HttpVersion11, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from idemproxy.core.types import StoredResponse
from idemproxy.errors import PayloadMismatch
from idemproxy.http.problems import problem_response
from idemproxy.proxy.server.connection import (
    AsSentResponse,
    SentResponse,
    own_server_header,
    serialise_whole,
)
from idemproxy.proxy.server.replay import replay_response

_DATE = re.compile(rb"\r\nDate: [^\r]*")


class _Transport(asyncio.Transport):
    """Keeps what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False


class _Protocol(BaseProtocol):
    """aiohttp's protocol base, with room for the attributes a mocked request sets."""

    writer: StreamWriter
    ssl_context = None
    peername = ("127.0.0.1", 40000)
    sockname = ("127.0.0.1", 8080)


def _request(
    method: str = "POST",
    version: HttpVersion = HttpVersion11,
    headers: dict[str, str] | None = None,
) -> tuple[web.Request, _Transport]:
    loop = asyncio.get_running_loop()
    transport = _Transport()
    protocol = _Protocol(loop)
    protocol.connection_made(transport)
    writer = StreamWriter(protocol, loop)
    app = web.Application()  # with the signal that `create_app` adds: what the client gets
    app.on_response_prepare.append(own_server_header(SERVER_SOFTWARE))
    app.freeze()
    request = make_mocked_request(
        method,
        "/charges",
        app=app,
        headers=CIMultiDict(headers or {}),
        version=version,
        writer=writer,
        protocol=protocol,
        transport=transport,
    )
    return request, transport


async def _by_aiohttp(request: web.Request, response: web.StreamResponse) -> None:
    await response.prepare(request)
    await response.write_eof()


def _plain() -> web.Response:
    return web.Response(body=b'{"id":1}', headers={"Content-Type": "application/json"})


def _closing() -> web.Response:
    response = _plain()
    response.force_close()
    return response


def _repeated() -> web.Response:
    headers = CIMultiDict([("Set-Cookie", "a=1"), ("X-Tag", "é"), ("Set-Cookie", "b=2")])
    return web.Response(status=201, reason="Made", body=b"ok", headers=headers)


def _replayed() -> web.StreamResponse:
    stored = StoredResponse(
        status=201, headers=(("Content-Type", "application/json"),), body=b'{"id":7}'
    )
    return replay_response("job-1", stored)


RESPONSES: dict[str, Callable[[], web.StreamResponse]] = {
    "json": _plain,
    "empty": lambda: web.Response(status=200),
    "no content type": lambda: web.Response(body=b"\x00\x01"),
    "text": lambda: web.Response(status=409, text="conflict"),
    "dated": lambda: web.Response(body=b"x", headers={"Date": "Sun, 06 Nov 1994 08:49:37 GMT"}),
    "closing": _closing,
    "repeated headers": _repeated,
    "replay": _replayed,
    "problem": lambda: problem_response(PayloadMismatch()),
}
CLIENTS = {
    "1.1": (HttpVersion11, {}),
    "1.1 close": (HttpVersion11, {"Connection": "close"}),
    "1.0": (HttpVersion10, {}),
    "1.0 keep-alive": (HttpVersion10, {"Connection": "keep-alive"}),
}


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("kind", RESPONSES)
async def test_the_bytes_and_persistence_are_aiohttps(kind: str, client: str) -> None:
    version, headers = CLIENTS[client]
    theirs, transport = _request(version=version, headers=headers)
    expected = RESPONSES[kind]()
    await _by_aiohttp(theirs, expected)

    ours, _ = _request(version=version, headers=headers)
    whole = serialise_whole(ours, RESPONSES[kind](), server_token=SERVER_SOFTWARE)

    assert whole is not None
    assert _fields(whole.data) == _fields(bytes(transport.written))
    assert whole.keep_alive is expected.keep_alive


def _fields(response: bytes) -> tuple[bytes, list[bytes], bytes]:
    """Status line, header lines (in the order of the aiohttp at hand, which differs between
    its minor versions; a client does not care), and body; without Date, which ticks."""
    head, _, body = _DATE.sub(b"", response).partition(b"\r\n\r\n")
    status, *fields = head.split(b"\r\n")
    return status, sorted(fields), body


async def test_a_fresh_date_unless_the_response_has_one() -> None:
    request, _ = _request()
    whole = serialise_whole(request, _plain(), server_token=SERVER_SOFTWARE)
    assert whole is not None
    assert re.search(rb"\r\nDate: \w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT\r\n", whole.data)


async def test_a_header_with_a_line_break_is_refused_as_aiohttp_refuses_it() -> None:
    request, _ = _request()
    response = web.Response(body=b"x", headers={"X-Evil": "a\r\nSet-Cookie: b"})
    with pytest.raises(ValueError, match="control character"):
        serialise_whole(request, response, server_token=SERVER_SOFTWARE)


def _streamed() -> web.StreamResponse:
    return web.StreamResponse()


def _chunked() -> web.Response:
    response = web.Response(body=b"x")
    response.enable_chunked_encoding()
    return response


def _compressed() -> web.Response:
    response = web.Response(body=b"x")
    response.enable_compression()
    return response


def _with_cookie() -> web.Response:
    response = web.Response(body=b"x")
    response.set_cookie("session", "1")
    return response


def _upstreams_with_cookie() -> web.Response:
    response = AsSentResponse(body=b"x")
    response.set_cookie("session", "1")
    return response


def _upstreams_with_jar_filled() -> web.Response:
    response = AsSentResponse(body=b"x")
    response.cookies["session"] = "1"
    return response


def _upstreams_with_cookie_deleted() -> web.Response:
    response = AsSentResponse(body=b"x")
    response.del_cookie("session")  # a Set-Cookie that expires it
    return response


def _with(header: str, value: str) -> Callable[[], web.Response]:
    return lambda: web.Response(body=b"x", headers={header: value})


LEFT_TO_AIOHTTP: dict[str, Callable[[], web.StreamResponse]] = {
    "streamed": _streamed,
    "chunked": _chunked,
    "compressed": _compressed,
    "cookie": _with_cookie,
    "upstream's, with a cookie of aiohttp's jar": _upstreams_with_cookie,
    "upstream's, its jar filled": _upstreams_with_jar_filled,
    "upstream's, a cookie deleted": _upstreams_with_cookie_deleted,
    "no content": lambda: web.Response(status=204),
    "not modified": lambda: web.Response(status=304),
    "interim": lambda: web.Response(status=103),
    "declared length": _with("Content-Length", "1"),
    "own framing": _with("Transfer-Encoding", "chunked"),
    "own persistence": _with("Connection", "close"),
}


@pytest.mark.parametrize("kind", LEFT_TO_AIOHTTP)
async def test_what_needs_more_goes_aiohttps_way(kind: str) -> None:
    request, _ = _request()
    assert serialise_whole(request, LEFT_TO_AIOHTTP[kind](), server_token=SERVER_SOFTWARE) is None


async def test_head_and_other_versions_go_aiohttps_way() -> None:
    head, _ = _request(method="HEAD")
    assert serialise_whole(head, _plain(), server_token=SERVER_SOFTWARE) is None
    ancient, _ = _request(version=HttpVersion(0, 9))
    assert serialise_whole(ancient, _plain(), server_token=SERVER_SOFTWARE) is None


async def test_a_response_written_whole_leaves_aiohttp_nothing_to_do() -> None:
    """What aiohttp's connection loop gets back for it (proxy/server/connection.py)."""
    request, _ = _request()
    for persistent in (True, False):
        sent = SentResponse(persistent=persistent)
        assert sent.keep_alive is persistent
        await sent.prepare(request)
        await sent.write_eof(b"never")
        assert not sent.prepared  # nothing was written through aiohttp's path
