"""The listener of `idemproxy serve` calls the proxy without aiohttp's router: what reaches the
client is what the app's router gave it (the proxy on aiohttp's own server, `handler_cancellation`
true), for the targets that are not the proxy's, `OPTIONS *` (forwarded), `Expect` and aiohttp's
own error page, down to the Server field (SPEC §10); and an absolute-form target without a path
is the proxy's, as it was when the listener routed it with its `/`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from multidict import CIMultiDict

import idemproxy.proxy.handler as handler_module
from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient, ProxyFactory


@dataclass(frozen=True)
class Answer:
    interim: bytes  # a `100 Continue` before the answer, or nothing
    status_line: str
    fields: CIMultiDict[str]
    body: bytes

    def shown(self) -> tuple[bytes, str, list[tuple[str, str]], bytes]:
        """All but Date, which moves with the clock, and what counts the upstream's executions
        (the two proxies share one upstream)."""
        fields = [(name, value) for name, value in self.fields.items() if name not in _MOVING]
        body = self.body if "Location" not in self.fields else b""
        return self.interim, self.status_line, fields, body


_MOVING = ("Date", "Location", "Content-Length")


async def _ask(port: int, head: bytes, body: bytes = b"") -> Answer:
    """One request on a new connection; the body is sent once a `100 Continue` came, if one
    was asked for and came, else at once."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        if b"Expect:" not in head or b" HTTP/1.0\r\n" in head:
            writer.write(body)
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        interim = b""
        if first.startswith(b"HTTP/1.1 100 "):
            interim = first
            writer.write(body)
            first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        lines = first.decode("latin-1").split("\r\n")
        fields: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                fields.add(name, value.strip())
        length = int(fields.get("Content-Length", "0"))
        content = await asyncio.wait_for(reader.readexactly(length), 5)
        return Answer(interim, lines[0], fields, content)
    finally:
        writer.close()


def _port(client: ProxyClient) -> int:
    port = client.server.port
    assert port is not None
    return port


async def _both(make_proxy: ProxyFactory, **settings: Any) -> tuple[int, int]:
    """The ports of the proxy behind the listener and behind aiohttp's own server (router)."""
    listener = await make_proxy(**settings)
    routed = await make_proxy(handler_cancellation=True, **settings)
    return _port(listener), _port(routed)


REQUESTS = {
    # `OPTIONS *` is forwarded (RFC 9112 §3.2.4): each named, to be the same on both.
    "asterisk": (b"OPTIONS * HTTP/1.1\r\nHost: proxy\r\nX-Request-Id: star-1\r\n\r\n", b""),
    "authority form": (b"CONNECT proxy:443 HTTP/1.1\r\nHost: proxy:443\r\n\r\n", b""),
    "asterisk, 100-continue": (
        b"OPTIONS * HTTP/1.1\r\nHost: proxy\r\nX-Request-Id: star-2\r\nContent-Length: 2\r\n"
        b"Expect: 100-continue\r\n\r\n",
        b"{}",
    ),
    "asterisk, unknown expectation": (
        b"OPTIONS * HTTP/1.1\r\nHost: proxy\r\nX-Request-Id: star-3\r\nContent-Length: 2\r\n"
        b"Expect: tea\r\n\r\n",
        b"{}",
    ),
    "100-continue": (
        b"POST /pay HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n",
        b"{}",
    ),
    "unknown expectation": (  # a problem: its id named, to be the same on both (SPEC §8)
        b"POST /pay HTTP/1.1\r\nHost: proxy\r\nX-Request-Id: tea-1\r\nContent-Length: 2\r\n"
        b"Expect: tea\r\n\r\n",
        b"{}",
    ),
    "HTTP/1.0 with an expectation": (
        b"POST /pay HTTP/1.0\r\nHost: proxy\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n",
        b"{}",
    ),
}


# Answered by the upstream: aiohttp's router there knows no `*` (its 404).
FORWARDED = ("asterisk", "asterisk, 100-continue")


@pytest.mark.parametrize("token", ["idemproxy", ""])
@pytest.mark.parametrize("name", list(REQUESTS))
async def test_the_listener_answers_as_the_router_did(
    make_proxy: ProxyFactory, sqlite_dsn: str, name: str, token: str
) -> None:
    listener, routed = await _both(make_proxy, store=sqlite_dsn, server={"server_token": token})
    head, body = REQUESTS[name]
    direct, through_router = await _ask(listener, head, body), await _ask(routed, head, body)
    if name == "authority form":
        # The listener closes after a CONNECT (SPEC §8: what follows it may be lost in the
        # parser); the router, in aiohttp's own server, keeps the connection.
        assert direct.fields.popall("Connection") == ["close"]
    assert direct.shown() == through_router.shown()
    if "Location" in direct.fields or name in FORWARDED:  # the upstream's: tests/support/backend.py
        assert direct.fields.getall("Server") == through_router.fields.getall("Server")
    else:  # the proxy's or aiohttp's own
        assert direct.fields.getall("Server", []) == ([token] if token else [])


@pytest.mark.parametrize("token", ["idemproxy", ""])
async def test_aiohttps_own_error_page_names_the_proxy(
    make_proxy: ProxyFactory, sqlite_dsn: str, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that raises gets aiohttp's 500, which aiohttp prepares itself: on the listener
    too it names the proxy as configured, never `Python/x aiohttp/y`."""

    async def broken(*_args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(handler_module.Proxy, "_route", broken)
    listener, routed = await _both(make_proxy, store=sqlite_dsn, server={"server_token": token})
    head = b"POST /pay HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n\r\n"
    direct, through_router = await _ask(listener, head, b"{}"), await _ask(routed, head, b"{}")
    assert direct.status_line == "HTTP/1.1 500 Internal Server Error"
    assert direct.shown() == through_router.shown()
    assert direct.fields.getall("Server", []) == ([token] if token else [])


async def test_an_absolute_form_target_without_a_path_asks_for_the_root(
    make_proxy: ProxyFactory, sqlite_dsn: str, ledger: Ledger
) -> None:
    """RFC 9112 §3.2.1: `GET http://proxy?x=1` asks for `/?x=1` (aiohttp's router alone answers
    it 404)."""
    listener = await make_proxy(store=sqlite_dsn)
    head = b"GET http://proxy?x=1 HTTP/1.1\r\nHost: proxy\r\n\r\n"
    answer = await _ask(_port(listener), head)
    assert answer.status_line == "HTTP/1.1 201 Created"
    assert [execution.path_qs for execution in ledger.executions] == ["/?x=1"]
