"""A request id joins everything (docs/operations.md, Logs): the client's `X-Request-Id`, or
one made up and sent upstream, in every log line of the request and in the proxy's own problem
documents; with tracing on, the log lines also name the trace and the request's span."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError

from idemproxy.config.settings import load_settings
from idemproxy.observe.logs import JsonFormatter, PlainFormatter
from idemproxy.proxy.app import create_app
from idemproxy.proxy.tracing import Tracing

Seen = list[dict[str, Any]]
KEY = "Idempotency-Key"


class Lines(logging.Handler):
    """Each record formatted as it is emitted, on the request's own context (as the proxy's
    writer does): JSON lines, and the plain ones."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.json: list[dict[str, Any]] = []
        self.plain: list[str] = []
        self._json, self._plain = JsonFormatter(), PlainFormatter()

    def emit(self, record: logging.LogRecord) -> None:
        self.json.append(json.loads(self._json.format(record)))
        self.plain.append(self._plain.format(record))

    def of(self, logger: str) -> list[dict[str, Any]]:
        return [line for line in self.json if line["logger"] == logger]


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, Seen]]:
    """An upstream that records the request ids it was sent, and answers 201 (or what
    `?status=` says; `?bad=1` adds a header value with a control character)."""
    seen: Seen = []

    async def handle(request: web.Request) -> web.Response:
        seen.append({"ids": request.headers.getall("X-Request-Id", []), "path": request.path})
        headers = {"X-Odd": "a\x01b"} if request.query.get("bad") else {}
        return web.Response(status=int(request.query.get("status", 201)), headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    async with TestServer(app) as server:
        yield str(server.make_url("")).rstrip("/"), seen


async def _proxy(
    url: str, store: str, tracing: Tracing | None = None, **more: Any
) -> TestClient[Any, Any]:
    settings = load_settings(upstream=url, store=store, **more)
    client = TestClient(TestServer(create_app(settings, tracing=tracing)))
    await client.start_server()
    return client


async def test_the_clients_id_goes_upstream_and_into_the_log_line(
    sqlite_dsn: str, upstream: tuple[str, Seen], lines: Lines
) -> None:
    url, seen = upstream
    proxy = await _proxy(url, sqlite_dsn)
    try:
        sent = {KEY: "k1", "X-Request-Id": "ingress-7f3a"}
        assert (await proxy.post("/pay", data=b"a", headers=sent)).status == 201
        replay = await proxy.post("/pay", data=b"a", headers={KEY: "k1", "X-Request-Id": "r-2"})
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert "X-Request-Id" not in replay.headers  # the upstream's answer: nothing added
    finally:
        await proxy.close()
    assert seen == [{"ids": ["ingress-7f3a"], "path": "/pay"}]
    requests = lines.of("idemproxy.requests")
    assert [(r["outcome"], r["request_id"]) for r in requests] == [
        ("new", "ingress-7f3a"),
        ("replayed", "r-2"),
    ]
    assert "trace_id" not in requests[0]
    plain = [line for line in lines.plain if "idemproxy.requests" in line]
    assert plain[0].endswith(" request_id=ingress-7f3a")


async def test_an_id_is_made_up_and_sent_upstream_when_none_came(
    sqlite_dsn: str, upstream: tuple[str, Seen], lines: Lines
) -> None:
    url, seen = upstream
    proxy = await _proxy(url, sqlite_dsn, access_log=True)
    try:
        assert (await proxy.post("/pay", data=b"a", headers={KEY: "k"})).status == 201
        assert (await proxy.get("/pay")).status == 201  # pass-through too
    finally:
        await proxy.close()
    made = [entry["ids"] for entry in seen]
    assert all(len(ids) == 1 for ids in made), made
    logged = [line["request_id"] for line in lines.of("idemproxy.requests")]
    assert logged == [ids[0] for ids in made]
    assert logged[0] != logged[1]
    for made_up in logged:
        uuid.UUID(made_up)


@pytest.mark.parametrize(
    "sent",
    [
        [("X-Request-Id", "x" * 230)],
        [("X-Request-Id", "has space")],
        [("X-Request-Id", "a"), ("X-Request-Id", "b")],
    ],
    ids=["too-long", "not-visible-ascii", "two"],
)
async def test_what_the_client_sent_goes_upstream_untouched_and_the_logs_get_an_id(
    sqlite_dsn: str, upstream: tuple[str, Seen], lines: Lines, sent: list[tuple[str, str]]
) -> None:
    """A value that cannot be the id is still the client's header: a route may key on it
    (SPEC §4.1), so it reaches the backend as sent; the log lines name one made up here."""
    url, seen = upstream
    proxy = await _proxy(url, sqlite_dsn)
    try:
        assert (await proxy.post("/pay", data=b"a", headers=[(KEY, "k"), *sent])).status == 201
    finally:
        await proxy.close()
    assert [entry["ids"] for entry in seen] == [[value for _, value in sent]]
    uuid.UUID(lines.of("idemproxy.requests")[0]["request_id"])


async def test_a_route_keyed_on_the_request_id_header_sends_the_key_as_it_came(
    sqlite_dsn: str, upstream: tuple[str, Seen]
) -> None:
    """A key of 201-255 characters is a valid key (SPEC §4) but no request id: released and
    retried, the backend sees the client's key both times, never an id made up per try."""
    url, seen = upstream
    route = {"prefix": "/", "upstream": url, "key": {"header": "X-Request-Id"}}
    proxy = await _proxy(url, sqlite_dsn, routes=[route])
    key = "r" * 230
    try:
        for _ in range(2):  # 503: released, nothing executed; the retry runs again
            answer = await proxy.post("/pay?status=503", data=b"a", headers={"X-Request-Id": key})
            assert answer.status == 503
    finally:
        await proxy.close()
    assert [entry["ids"] for entry in seen] == [[key], [key]]


@pytest.mark.parametrize(
    ("header", "owner"),
    [("Authorization", "authorization"), ("cookie", "none"), ("X-Tenant", "header:X-Tenant")],
)
def test_a_credential_is_never_the_request_id(header: str, owner: str) -> None:
    with pytest.raises(ValidationError, match="request_id_header"):
        load_settings(
            upstream="http://127.0.0.1:9", request_id_header=header, owner={"strategy": owner}
        )


@pytest.mark.parametrize(
    "header",
    [
        "X-Forwarded-For",
        "forwarded",
        "X-Forwarded-Host",
        "X-Forwarded-Proto",
        "X-Original-URL",
        "Content-Length",
        "Transfer-Encoding",
        "Host",
        "Connection",
        "TE",
        "Upgrade",
        "Idempotency-Job",
        "Idempotency-Attempt",
        "Idempotent-Replayed",
        "Idempotency-Error",
    ],
)
def test_a_header_the_proxy_sets_is_never_the_request_id(header: str) -> None:
    """A made-up id goes upstream in the request id header: it would replace the proxy's own
    forwarding value or framing, or hand the backend a job id or a key no client sent."""
    with pytest.raises(ValidationError, match=r"request_id_header: .* by the proxy itself"):
        load_settings(upstream="http://127.0.0.1:9", request_id_header=header)


def test_the_key_header_is_never_the_request_id() -> None:
    upstream = "http://127.0.0.1:9"
    with pytest.raises(ValidationError, match=r"request_id_header: .*\(key_header\)"):
        load_settings(upstream=upstream, key_header="X-Op-Id", request_id_header="x-op-id")
    # `Idempotency-Key` is the proxy's own too, even where another header is the key.
    with pytest.raises(ValidationError, match="request_id_header: Idempotency-Key is framed"):
        load_settings(upstream=upstream, key_header="X-Op", request_id_header="Idempotency-Key")
    # Any other name is fine.
    assert load_settings(upstream=upstream, request_id_header="X-Trace").request_id_header


async def test_problem_documents_and_every_line_of_the_request_carry_it(
    sqlite_dsn: str, upstream: tuple[str, Seen], lines: Lines
) -> None:
    url, _seen = upstream
    proxy = await _proxy(url, sqlite_dsn)
    try:
        # The upstream resets the connection (its server refuses the header it was to send).
        cut = await proxy.post("/pay?bad=1", data=b"a", headers={KEY: "c", "X-Request-Id": "r0"})
        assert cut.status == 502
        assert (await cut.json())["request_id"] == "r0"
        first = {KEY: "k", "X-Request-Id": "req-1"}
        assert (await proxy.post("/pay", data=b"a", headers=first)).status == 201
        again = {KEY: "k", "X-Request-Id": "req-2"}
        mismatch = await proxy.post("/pay", data=b"other", headers=again)
        assert mismatch.status == 409
        problem = await mismatch.json()
        assert problem["request_id"] == "req-2"
        assert mismatch.headers["X-Request-Id"] == "req-2"  # the proxy's own answer
        invalid = await proxy.post("/pay", data=b"a", headers={KEY: ""})
        made = (await invalid.json())["request_id"]
        assert invalid.headers["X-Request-Id"] == made
        uuid.UUID(made)
    finally:
        await proxy.close()
    # The failed attempt's warning, logged in the attempt's own task, names its request.
    [failed] = [line for line in lines.of("idemproxy.proxy.jobs.jobrun")]
    assert failed["level"] == "warning" and failed["request_id"] == "r0", failed


@pytest.mark.parametrize(
    ("expect", "status", "code"),
    [(b"100-continue", b"413", "body-too-large"), (b"x-unknown", b"417", "expectation-failed")],
)
async def test_a_body_refused_at_expect_carries_it(
    sqlite_dsn: str, upstream: tuple[str, Seen], expect: bytes, status: bytes, code: str
) -> None:
    """The 413 given before a declared over-size body is invited, and the 417 of an unknown
    expectation (RFC 9110 §10.1.1), are answered before the request's handler runs: each is a
    problem that carries the request's id all the same (SPEC §8), and ends the connection."""
    url, seen = upstream
    proxy = await _proxy(url, sqlite_dsn, max_request_body=1024)
    try:
        assert proxy.server.port is not None
        answers = []
        for ids in (b"X-Request-Id: exp-1\r\n", b""):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
            writer.write(
                b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: k\r\n"
                + ids
                + b"Content-Length: 4096\r\nExpect: "
                + expect
                + b"\r\n\r\n"
            )
            answers.append(await asyncio.wait_for(reader.read(65536), 10))
            writer.close()
            await writer.wait_closed()
    finally:
        await proxy.close()
    assert seen == []
    for answer, sent in zip(answers, ("exp-1", None), strict=True):
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 " + status + b" "), answer
        assert b"\r\nConnection: close" in head  # the body never invited (RFC 9110 §10.1.1)
        problem = json.loads(body)
        assert (problem["code"], problem["job_state"], problem["retry"]) == (
            code,
            "none",
            "new-key-safe",
        )
        given = problem["request_id"]
        assert given == sent if sent is not None else uuid.UUID(given)
        assert f"\r\nX-Request-Id: {given}\r\n".encode() in head + b"\r\n"


async def test_off_when_the_header_is_empty(
    sqlite_dsn: str, upstream: tuple[str, Seen], lines: Lines
) -> None:
    url, seen = upstream
    proxy = await _proxy(url, sqlite_dsn, request_id_header="")
    try:
        assert (await proxy.post("/pay", data=b"a", headers={KEY: "k"})).status == 201
        problem = await (await proxy.post("/pay", data=b"a", headers={KEY: ""})).json()
    finally:
        await proxy.close()
    assert seen == [{"ids": [], "path": "/pay"}]
    assert "request_id" not in problem
    assert all("request_id" not in line for line in lines.json)


async def test_with_tracing_the_lines_name_the_trace_and_span(
    sqlite_dsn: str, upstream: tuple[str, Seen], lines: Lines
) -> None:
    url, _seen = upstream
    exporter = InMemorySpanExporter()
    proxy = await _proxy(url, sqlite_dsn, tracing=Tracing.exporting_to(exporter))
    try:
        parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        headers = {KEY: "k", "traceparent": parent, "X-Request-Id": "t-1"}
        assert (await proxy.post("/pay", data=b"a", headers=headers)).status == 201
    finally:
        await proxy.close()
    [server] = [span for span in exporter.get_finished_spans() if span.kind.name == "SERVER"]
    [line] = lines.of("idemproxy.requests")
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"  # the client's trace, continued
    assert line["span_id"] == f"{server.context.span_id:016x}"
    assert line["request_id"] == "t-1"
