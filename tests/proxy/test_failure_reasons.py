"""The `reason` of a failed request's log line, against upstreams that really fail (SPEC §13):
one word of a closed set, and a WARNING that names the upstream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from idemproxy.core.machine import Failure
from idemproxy.errors import StoreUnavailable
from idemproxy.observe.metrics import Metrics, RequestOutcome
from idemproxy.proxy.reasons import FailureReason, upstream_reason
from idemproxy.proxy.server.trace import Trace, record
from idemproxy.proxy.upstream.client import UpstreamFailure
from tests.support.ports import free_port
from tests.support.proxyapp import ProxyFactory

Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _upstream(behaviour: Behaviour, *, read_head: bool = True) -> AsyncIterator[int]:
    """A raw TCP upstream that reads the request head (unless not `read_head`), then does
    `behaviour`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                if read_head:
                    await reader.readuntil(b"\r\n\r\n")
                await behaviour(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 1)


async def _reset(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    # SO_LINGER 0: close sends an RST, not a FIN.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _stall(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
    await reader.read()  # until the proxy gives up and closes


async def _garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    await writer.drain()
    await reader.read()


async def _plain_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    await writer.drain()
    await reader.read()


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [r.fields for r in caplog.records if r.name == "idemproxy.requests"]  # type: ignore[attr-defined]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


async def _governed_post(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    upstream: str,
    caplog: pytest.LogCaptureFixture,
    **overrides: Any,
) -> dict[str, object]:
    caplog.set_level(logging.INFO)
    client = await make_proxy(
        store=sqlite_dsn, upstream=upstream, upstream_timeout=0.5, **overrides
    )
    response = await client.post("/pay?x=1", data=b"{}", headers={"Idempotency-Key": "k1"})
    assert response.status >= 500
    [line] = _lines(caplog)
    assert line["status"] == response.status
    return line


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [
        (_reset, FailureReason.RESET),
        (_stall, FailureReason.TIMEOUT),
        (_garbage, FailureReason.INVALID_RESPONSE),
    ],
)
async def test_a_failing_upstream_gives_its_reason(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    caplog: pytest.LogCaptureFixture,
    behaviour: Behaviour,
    reason: FailureReason,
) -> None:
    async with _upstream(behaviour) as port:
        origin = f"http://127.0.0.1:{port}"
        line = await _governed_post(make_proxy, sqlite_dsn, origin + "/base", caplog)
    assert line["reason"] == reason
    assert line["upstream"] == origin and line["route"] == "/"
    assert line["method"] == "POST" and line["path"] == "/pay"
    assert any(origin in text and str(reason) in text for text in _warnings(caplog))


async def test_a_refused_connection_is_connect_refused(
    make_proxy: ProxyFactory, sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    origin = f"http://127.0.0.1:{free_port()}"
    line = await _governed_post(make_proxy, sqlite_dsn, origin, caplog)
    assert line["reason"] == FailureReason.CONNECT_REFUSED
    assert any(origin in text and "connect-refused" in text for text in _warnings(caplog))


async def test_a_tls_upstream_that_answers_in_plain_text_is_tls(
    make_proxy: ProxyFactory, sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with _upstream(_plain_answer, read_head=False) as port:
        line = await _governed_post(make_proxy, sqlite_dsn, f"https://127.0.0.1:{port}", caplog)
    assert line["reason"] == FailureReason.TLS


async def test_a_tls_handshake_never_answered_is_connect_timeout(
    make_proxy: ProxyFactory, sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The connection is accepted and the ClientHello never answered."""
    async with _upstream(_stall, read_head=False) as port:
        line = await _governed_post(
            make_proxy, sqlite_dsn, f"https://127.0.0.1:{port}", caplog, connect_timeout=0.3
        )
    assert line["reason"] == FailureReason.CONNECT_TIMEOUT


async def test_a_pass_through_failure_is_in_the_access_log(
    make_proxy: ProxyFactory, sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    origin = f"http://127.0.0.1:{free_port()}"
    client = await make_proxy(store=sqlite_dsn, upstream=origin, access_log=True)
    response = await client.get("/balance")
    assert response.status == 502
    [line] = _lines(caplog)
    assert line["outcome"] == "passthrough" and line["reason"] == FailureReason.CONNECT_REFUSED
    assert line["upstream"] == origin and line["method"] == "GET" and line["path"] == "/balance"
    assert any(origin in text and "connect-refused" in text for text in _warnings(caplog))


def test_an_unusable_upstream_url_is_connect_failed() -> None:
    failure = UpstreamFailure(Failure.CONNECT, "unsupported upstream URL: ftp://x")
    assert upstream_reason(failure) == FailureReason.CONNECT_FAILED


def test_an_unavailable_store_is_store(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    trace = Trace()
    trace.problem(StoreUnavailable())
    record(Metrics(), trace, 503, log_requests=True)
    [line] = _lines(caplog)
    assert line["reason"] == FailureReason.STORE and line["outcome"] == "unavailable"


def test_a_failure_made_good_by_a_fallback_logs_no_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    trace = Trace()
    trace.failed("http://primary:8080", FailureReason.CONNECT_REFUSED)
    trace.outcome, trace.job_id, trace.attempt = RequestOutcome.NEW, "j-1", 2  # it ran the job
    record(Metrics(), trace, 201, log_requests=True)
    [line] = _lines(caplog)
    assert "reason" not in line or line["reason"] is None
