"""OpenTelemetry traces (proxy/tracing.py, docs/operations.md, Tracing): the span tree of each
kind of request, read back from the SDK's in-memory exporter, and the `traceparent` the
upstream gets. All tests run on SQLite and PostgreSQL (`store_dsn`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from idemproxy.config.settings import load_settings
from idemproxy.proxy.app import create_app
from idemproxy.proxy.tracing import Tracing
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.named_upstream import NamedUpstream
from tests.support.proxyapp import ProxyClient
from tests.support.proxychecks import KEY, closed_port, eventually, wait_for_jobs

from .conftest import RawUpstream, ServeListener, Server

Traced = Callable[..., Awaitable[ProxyClient]]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def traced(
    store_dsn: str, backend_url: str, exporter: InMemorySpanExporter
) -> AsyncIterator[Traced]:
    """`await traced(**settings)`: the proxy app with tracing on, exporting to `exporter`."""
    clients: list[ProxyClient] = []

    async def make(**overrides: Any) -> ProxyClient:
        settings = load_settings(
            **{"upstream": backend_url, "store": store_dsn, "tracing": {"enabled": True}}
            | overrides
        )
        app = create_app(settings, tracing=Tracing.exporting_to(exporter))
        client = TestClient(
            ServeListener(app, settings.server), cookie_jar=aiohttp.DummyCookieJar()
        )
        await client.start_server()
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for client in reversed(clients):
            await client.close()


def servers(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> list[ReadableSpan]:
    """The spans whose parent is `parent`, in the order they started."""
    found = [
        s
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == span_id(parent)
    ]
    return sorted(found, key=lambda s: s.start_time or 0)


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.trace_id)


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def traceparent_of(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"00-{trace_id(span):032x}-{span_id(span):016x}-{span.context.trace_flags:02x}"


async def finished(exporter: InMemorySpanExporter, count: int) -> None:
    """Until `count` server spans have ended (the handler returns before the client reads)."""
    await eventually(lambda: len(servers(exporter)) >= count)


async def test_a_new_key_is_a_server_span_with_claim_attempt_and_completion(
    traced: Traced, exporter: InMemorySpanExporter, ledger: Ledger
) -> None:
    client = await traced()
    async with client.post("/payments?secret=s3", data=b"pay", headers={KEY: "k1"}) as response:
        assert response.status == 201
        job_id = response.headers["Idempotency-Job"]
    await finished(exporter, 1)

    [server] = servers(exporter)
    assert server.name == "POST"
    assert server.parent is None  # no traceparent from the client: a new trace
    server_attributes = attributes(server)
    assert server_attributes["http.request.method"] == "POST"
    assert server_attributes["url.path"] == "/payments"  # never the query string
    assert server_attributes["http.response.status_code"] == 201
    assert server_attributes["server.address"] == "127.0.0.1"
    assert server_attributes["idemproxy.outcome"] == "new"
    assert server_attributes["idemproxy.job.id"] == job_id
    assert server_attributes["idemproxy.attempt"] == 1
    assert server_attributes["idemproxy.owner"] == "anonymous"
    assert "idemproxy.replayed" not in server_attributes
    assert server.status.status_code is StatusCode.UNSET
    assert all("s3" not in str(value) for value in server_attributes.values())

    claim, attempt = children(exporter, server)
    assert (claim.name, claim.kind) == ("idemproxy.claim", SpanKind.INTERNAL)
    assert attributes(claim)["idemproxy.job.id"] == job_id
    assert attributes(claim)["idemproxy.claimed"] is True
    assert (attempt.name, attempt.kind) == ("POST", SpanKind.CLIENT)
    attempt_attributes = attributes(attempt)
    assert attempt_attributes["idemproxy.job.id"] == job_id
    assert attempt_attributes["idemproxy.attempt"] == 1
    assert attempt_attributes["http.response.status_code"] == 201
    assert attempt_attributes["url.full"].endswith("/payments")
    assert attempt_attributes["server.address"] == "127.0.0.1"

    [complete] = children(exporter, attempt)
    assert complete.name == "idemproxy.complete"
    assert attributes(complete)["idemproxy.won"] is True
    assert {trace_id(s) for s in exporter.get_finished_spans()} == {trace_id(server)}

    # The backend's spans join the trace: it got the attempt span's context.
    [execution] = ledger.executions
    assert execution.header("traceparent") == traceparent_of(attempt)


async def test_a_replay_is_a_replay_span_and_no_attempt(
    traced: Traced, exporter: InMemorySpanExporter, ledger: Ledger
) -> None:
    client = await traced()
    for _ in range(2):
        async with client.post("/payments", data=b"pay", headers={KEY: "again"}) as response:
            assert response.status == 201
    await finished(exporter, 2)

    first, second = sorted(servers(exporter), key=lambda s: s.start_time or 0)
    assert trace_id(first) != trace_id(second)
    assert attributes(second)["idemproxy.outcome"] == "replayed"
    assert attributes(second)["idemproxy.replayed"] is True
    assert attributes(second)["idemproxy.job.id"] == attributes(first)["idemproxy.job.id"]
    claim, replay = children(exporter, second)
    assert claim.name == "idemproxy.claim"
    assert attributes(claim)["idemproxy.claimed"] is False
    assert replay.name == "idemproxy.replay"
    assert attributes(replay)["http.response.status_code"] == 201
    assert ledger.count("again") == 1


async def test_a_held_duplicate_has_a_hold_span_then_the_replay(
    traced: Traced, exporter: InMemorySpanExporter, jobs: Store
) -> None:
    client = await traced()

    async def post() -> int:
        async with client.post("/pay?delay=0.4", data=b"x", headers={KEY: "held"}) as response:
            return response.status

    first = asyncio.create_task(post())
    await wait_for_jobs(jobs)
    assert await post() == 201
    assert await first == 201
    await finished(exporter, 2)

    [held] = [s for s in servers(exporter) if attributes(s)["idemproxy.outcome"] == "held"]
    assert attributes(held)["idemproxy.replayed"] is True
    names = [s.name for s in children(exporter, held)]
    assert names == ["idemproxy.claim", "idemproxy.hold", "idemproxy.replay"]
    hold = children(exporter, held)[1]
    assert attributes(hold)["idemproxy.job.state"] == "completed"
    assert hold.end_time is not None and hold.start_time is not None
    assert hold.end_time - hold.start_time > 0.1e9  # it waited for the attempt in flight


async def test_a_fail_over_is_one_client_span_per_attempt(
    traced: Traced, exporter: InMemorySpanExporter
) -> None:
    upstream = NamedUpstream("fallback")
    server = Server(upstream.app())
    await server.start_server()
    try:
        upstream.url = f"http://{server.host}:{server.port}"
        port = server.port
        client = await traced(
            upstream=f"http://127.0.0.1:{closed_port()}", fallbacks=[upstream.url]
        )
        async with client.post("/v1/chat", json={"q": 1}, headers={KEY: "over"}) as response:
            assert response.status == 200
        await finished(exporter, 1)
    finally:
        await server.close()

    [request] = servers(exporter)
    claim, refused, answered = children(exporter, request)
    assert claim.name == "idemproxy.claim"
    assert (refused.kind, answered.kind) == (SpanKind.CLIENT, SpanKind.CLIENT)
    assert attributes(refused)["idemproxy.attempt"] == 1
    assert attributes(refused)["idemproxy.outcome"] == "release"
    assert attributes(refused)["error.type"] == "upstream-unavailable"
    assert str(attributes(refused)["idemproxy.error"]).startswith("connect failed")
    assert refused.status.status_code is StatusCode.ERROR
    assert attributes(answered)["idemproxy.attempt"] == 2
    assert attributes(answered)["server.port"] == port
    assert answered.status.status_code is StatusCode.UNSET
    assert [s.name for s in children(exporter, answered)] == ["idemproxy.complete"]
    assert attributes(request)["idemproxy.attempt"] == 1  # the attempt the request claimed
    [execution] = upstream.received
    assert execution.header("traceparent") == traceparent_of(answered)


async def test_the_clients_traceparent_is_continued(
    traced: Traced, exporter: InMemorySpanExporter, ledger: Ledger
) -> None:
    client = await traced()
    headers = {KEY: "joined", "traceparent": CLIENT_TRACEPARENT}
    async with client.post("/payments", data=b"pay", headers=headers) as response:
        assert response.status == 201
    await finished(exporter, 1)

    [server] = servers(exporter)
    assert f"{trace_id(server):032x}" == CLIENT_TRACE
    assert server.parent is not None and f"{server.parent.span_id:016x}" == CLIENT_SPAN
    assert server.parent.is_remote
    [execution] = ledger.executions
    attempt = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT)
    # Not the client's own traceparent: the attempt's, in the client's trace.
    assert execution.header("traceparent") == traceparent_of(attempt)
    assert f"{trace_id(attempt):032x}" == CLIENT_TRACE


async def test_a_pass_through_is_a_server_and_a_client_span(
    traced: Traced, exporter: InMemorySpanExporter, ledger: Ledger
) -> None:
    client = await traced()
    async with client.get("/items?status=404") as response:
        assert response.status == 404
    await finished(exporter, 1)

    [server] = servers(exporter)
    assert server.name == "GET"
    assert attributes(server)["idemproxy.outcome"] == "passthrough"
    assert server.status.status_code is StatusCode.UNSET  # a server's 4xx is the client's
    [forwarded] = children(exporter, server)
    assert (forwarded.name, forwarded.kind) == ("GET", SpanKind.CLIENT)
    assert attributes(forwarded)["http.response.status_code"] == 404
    assert forwarded.status.status_code is StatusCode.ERROR  # for a client, it is an error
    [execution] = ledger.executions
    assert execution.header("traceparent") == traceparent_of(forwarded)


async def test_a_problem_answer_carries_its_code(
    traced: Traced, exporter: InMemorySpanExporter
) -> None:
    client = await traced(upstream=f"http://127.0.0.1:{closed_port()}")
    async with client.post("/payments", data=b"pay", headers={KEY: "down"}) as response:
        assert response.status == 502
    await finished(exporter, 1)

    [server] = servers(exporter)
    assert attributes(server)["idemproxy.problem"] == "upstream-unavailable"
    assert attributes(server)["error.type"] == "upstream-unavailable"
    assert server.status.status_code is StatusCode.ERROR
    claim, attempt = children(exporter, server)
    assert claim.name == "idemproxy.claim"
    assert attributes(attempt)["idemproxy.problem"] == "upstream-unavailable"
    assert str(attributes(attempt)["idemproxy.error"]).startswith("connect failed")
    assert attributes(attempt)["idemproxy.outcome"] == "release"
    assert attempt.status.status_code is StatusCode.ERROR
    [settle] = children(exporter, attempt)
    assert settle.name == "idemproxy.settle"
    assert attributes(settle)["idemproxy.job.state"] == "released"


async def test_with_tracing_off_the_upstream_gets_no_trace_header_of_the_proxy(
    store_dsn: str, raw_upstream: RawUpstream
) -> None:
    """Off: the request goes upstream exactly as without tracing; a client's traceparent is
    forwarded as any other end-to-end header."""
    settings = load_settings(upstream=raw_upstream.url, store=store_dsn)
    app = create_app(settings)
    client = TestClient(ServeListener(app, settings.server))
    await client.start_server()
    try:
        async with client.post("/p", data=b"x", headers={KEY: "off"}) as response:
            assert response.status == 200
        headers = {KEY: "off-2", "traceparent": CLIENT_TRACEPARENT}
        async with client.post("/p", data=b"x", headers=headers) as response:
            assert response.status == 200
    finally:
        await client.close()
    first, second = raw_upstream.heads
    assert b"traceparent" not in first.lower()
    assert f"traceparent: {CLIENT_TRACEPARENT}\r\n".encode() in second


class _StuckExporter(SpanExporter):
    """A collector that never answers: each export waits until the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(10)
        return SpanExportResult.SUCCESS


async def test_the_flush_at_shutdown_waits_no_longer_than_its_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter = _StuckExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracing = Tracing(provider, flush_timeout=0.2)
    provider.get_tracer("test").start_span("queued").end()
    began = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="idemproxy.proxy.tracing"):
            await tracing.shutdown()
        assert time.monotonic() - began < 2.0
        assert "unexported after 0.2s" in caplog.text
    finally:
        exporter.release.set()


async def test_a_pass_through_to_an_upstream_that_refuses_says_why(
    traced: Traced, exporter: InMemorySpanExporter
) -> None:
    client = await traced(upstream=f"http://127.0.0.1:{closed_port()}")
    async with client.get("/items") as response:
        assert response.status == 502
    await finished(exporter, 1)

    [server] = servers(exporter)
    [forwarded] = children(exporter, server)
    assert str(attributes(forwarded)["idemproxy.error"]).startswith("connect failed")
    assert attributes(forwarded)["idemproxy.problem"] == "upstream-unavailable"
    assert forwarded.status.status_code is StatusCode.ERROR


@pytest.mark.parametrize(
    ("host", "status"),
    # A non-ASCII Host is the proxy's own 400 (header-invalid), not a failure of the span.
    [("shop:\u00b2", 400), ("shop:99999999999999999999", 201), ("shop:65536", 201)],
)
async def test_a_host_whose_port_is_no_port_is_answered_and_spanned_without_it(
    traced: Traced, exporter: InMemorySpanExporter, host: str, status: int
) -> None:
    client = await traced()
    async with client.get("/items", headers={"Host": host}) as response:
        assert response.status == status
    await finished(exporter, 1)

    [server] = servers(exporter)
    assert attributes(server)["server.address"] == host
    assert "server.port" not in attributes(server)


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN.upper()}-01",
        f"00-{'0' * 32}-{CLIENT_SPAN}-01",
    ],
)
@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_an_unparseable_traceparent_restarts_the_trace_without_the_clients_tracestate(
    traced: Traced,
    exporter: InMemorySpanExporter,
    ledger: Ledger,
    traceparent: str,
    method: str,
) -> None:
    client = await traced()
    headers = {KEY: "restarted", "traceparent": traceparent, "tracestate": "vendor=theirs"}
    async with client.request(method, "/payments", data=b"pay", headers=headers) as response:
        assert response.status == 201
    await finished(exporter, 1)

    [server] = servers(exporter)
    assert server.parent is None  # a new trace, not the client's
    [execution] = ledger.executions
    forwarded = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT)
    assert execution.header("traceparent") == traceparent_of(forwarded)
    assert [k for k, _ in execution.headers if k.lower() == "tracestate"] == []


async def test_a_continued_trace_sends_its_tracestate_once(
    traced: Traced, exporter: InMemorySpanExporter, ledger: Ledger
) -> None:
    client = await traced()
    headers = {KEY: "joined", "traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=theirs"}
    async with client.post("/payments", data=b"pay", headers=headers) as response:
        assert response.status == 201
    await finished(exporter, 1)

    [execution] = ledger.executions
    assert [v for k, v in execution.headers if k.lower() == "tracestate"] == ["vendor=theirs"]


async def test_spans_carry_no_session_id_of_the_path(
    traced: Traced, exporter: InMemorySpanExporter
) -> None:
    """SPEC §13: a session id in a path parameter is a credential, in a span as in a log line
    (spans usually go to another party's backend)."""
    client = await traced()
    path = "/payments;jsessionid=s3cr3t"
    async with client.post(path, data=b"pay", headers={KEY: "k-sess"}) as response:
        assert response.status == 201
    await finished(exporter, 1)
    [server] = servers(exporter)
    [_claim, attempt] = children(exporter, server)
    assert attributes(server)["url.path"] == "/payments;jsessionid=***"
    assert attributes(attempt)["url.full"].endswith("/payments;jsessionid=***")
    assert all(
        "s3cr3t" not in str(v)
        for s in exporter.get_finished_spans()
        for v in attributes(s).values()
    )
