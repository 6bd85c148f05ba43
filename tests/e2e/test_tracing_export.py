"""A real `idemproxy serve` exporting its traces over OTLP/HTTP (docs/operations.md, Tracing):
a receiver in the test decodes each export with the official `opentelemetry-proto` messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.support.proxychecks import KEY

if TYPE_CHECKING:
    from .conftest import Backend, StartProxy

pytestmark = pytest.mark.slow
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"


class Collector:
    """An OTLP/HTTP trace receiver: every export request, decoded."""

    def __init__(self) -> None:
        self.exports: list[ExportTraceServiceRequest] = []
        self.content_types: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.content_types.append(request.content_type)
        self.exports.append(ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def spans(self) -> list[tuple[dict[str, str], Span]]:
        """(resource attributes, span) for every span received."""
        found: list[tuple[dict[str, str], Span]] = []
        for export in self.exports:
            for resource_spans in export.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    found.extend((resource, span) for span in scope_spans.spans)
        return found


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, str]]:
    received = Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", received.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield received, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def attribute(span: Span, name: str) -> object:
    for pair in span.attributes:
        if pair.key == name:
            value = pair.value
            return getattr(value, value.WhichOneof("value") or "string_value")
    return None


async def test_the_spans_of_a_new_key_and_its_replay_reach_the_collector(
    start_proxy: StartProxy, backend: Backend, collector: tuple[Collector, str], tmp_path: Path
) -> None:
    received, endpoint = collector
    proxy = await start_proxy(
        "--upstream",
        backend.url,
        "--store",
        f"sqlite:///{tmp_path}/idemproxy.db",
        env={
            "IDEMPROXY_TRACING__ENABLED": "true",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=test",
            # Longer than the test: these spans go out with the flush at shutdown.
            "OTEL_BSP_SCHEDULE_DELAY": "60000",
        },
    )
    headers = {KEY: "traced", "traceparent": CLIENT_TRACEPARENT}
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(f"{proxy.url}/pay", data=b"x", headers=headers) as response:
                assert response.status == 201
    await asyncio.sleep(0.1)
    assert received.exports == []  # still queued in the batch processor
    assert await proxy.terminate() == 0, proxy.describe()

    spans = received.spans()
    assert received.content_types and set(received.content_types) == {"application/x-protobuf"}
    resource = spans[0][0]
    assert resource["service.name"] == "idemproxy"
    assert resource["deployment.environment.name"] == "test"
    assert {span.trace_id.hex() for _, span in spans} == {CLIENT_TRACE}
    names = sorted((span.name, span.kind) for _, span in spans)
    server, client, internal = Span.SPAN_KIND_SERVER, Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_INTERNAL
    assert names == sorted(
        [
            ("POST", server),
            ("POST", server),
            ("POST", client),
            ("idemproxy.claim", internal),
            ("idemproxy.claim", internal),
            ("idemproxy.complete", internal),
            ("idemproxy.replay", internal),
        ]
    )
    outcomes = sorted(
        str(attribute(span, "idemproxy.outcome")) for _, span in spans if span.kind == server
    )
    assert outcomes == ["new", "replayed"]
    [attempt] = [span for _, span in spans if span.kind == client]
    [execution] = backend.ledger.executions
    sent = execution.header("traceparent")
    assert sent is not None and sent.split("-")[2] == attempt.span_id.hex()
    assert "Traceback" not in proxy.stderr()
