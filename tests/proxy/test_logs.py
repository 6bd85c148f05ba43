"""Structured request logs (SPEC §13): job id, attempt, owner hash prefix and outcome on every
governed request; never a body, a credential or a key's header value beyond the key itself."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from idemproxy.config.settings import load_settings
from idemproxy.identity.intent import hash_credential
from idemproxy.observe.logs import JsonFormatter, PlainFormatter, configure_logging
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.app import create_app
from idemproxy.proxy.server import trace as trace_module
from idemproxy.proxy.server.trace import Trace, record
from tests.support.backend import Ledger, backend_app
from tests.support.proxychecks import closed_port

SECRET = "Bearer s3cr3t-token"
BODY = b'{"card": "4111111111111111"}'


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """`configure_logging` changes process-wide state: put it back for the other tests."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers), logging.getLogger("asyncpg").level)
    yield
    root.setLevel(saved[0])
    for handler in root.handlers:
        if handler not in saved[1]:
            handler.close()  # its writer thread ends
    root.handlers[:] = saved[1]
    logging.getLogger("asyncpg").setLevel(saved[2])


async def _exchange(sqlite_dsn: str, **overrides: Any) -> None:
    async with TestServer(backend_app(Ledger())) as backend:
        settings = load_settings(
            upstream=str(backend.make_url("")).rstrip("/"), store=sqlite_dsn, **overrides
        )
        async with TestClient(TestServer(create_app(settings))) as proxy:
            headers = {"Idempotency-Key": "k1", "Authorization": SECRET}
            for _ in range(2):
                response = await proxy.post("/pay", data=BODY, headers=headers)
                assert response.status == 201
            await proxy.get("/pay", headers=headers)


def _request_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "idemproxy.requests"]


async def test_each_governed_request_logs_its_outcome(
    sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    await _exchange(sqlite_dsn)
    records = _request_records(caplog)
    assert [r.fields["outcome"] for r in records] == ["new", "replayed"]  # type: ignore[attr-defined]
    first, second = (r.fields for r in records)  # type: ignore[attr-defined]
    assert first["job"] == second["job"] and first["attempt"] == 1
    assert first["owner"] == hash_credential(SECRET)[:8]
    assert first["status"] == 201


@pytest.mark.usefixtures("logging_restored")
async def test_logs_carry_no_body_and_no_credential(
    sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    configure_logging("debug", "json")  # even at debug level, as `serve --log-level debug`
    caplog.set_level(logging.DEBUG)
    await _exchange(sqlite_dsn)
    formatter = JsonFormatter()
    text = "\n".join(formatter.format(r) for r in caplog.records)
    assert "s3cr3t" not in text
    assert "4111111111111111" not in text
    assert hash_credential(SECRET) not in text  # only a prefix of the owner hash


async def test_json_lines_hold_the_fields(
    sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    await _exchange(sqlite_dsn)
    line = json.loads(JsonFormatter().format(_request_records(caplog)[0]))
    assert {
        "time",
        "level",
        "message",
        "outcome",
        "job",
        "attempt",
        "owner",
        "status",
        "ms",
    } <= set(line)


async def test_request_logging_can_be_turned_off(
    sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    await _exchange(sqlite_dsn, log_requests=False)
    assert _request_records(caplog) == []


def _request_line(fields_owner: str = "ab" * 32) -> logging.LogRecord:
    """The record `trace.record` hands to the logging system for one replayed request."""
    caught: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record)

    logger = logging.getLogger("idemproxy.requests")
    handler, level = Catch(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trace = Trace()
        trace.owner = fields_owner
        trace.replayed("0190b2c4-0000-7000-8000-000000000000")
        record(Metrics(), trace, 201, log_requests=True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    (line,) = caught
    return line


def test_the_request_record_has_every_attribute_makerecord_gives_it() -> None:
    line = _request_line()
    logger = logging.getLogger("idemproxy.requests")
    made = logger.makeRecord(
        logger.name,
        logging.INFO,
        trace_module.__file__,
        line.lineno,
        line.msg,
        (),
        None,
        "record",
        {"fields": line.fields},  # type: ignore[attr-defined]
    )
    assert set(vars(made)) <= set(vars(line))
    for name in vars(made):
        if name not in ("created", "msecs", "relativeCreated"):
            assert getattr(line, name) == getattr(made, name), name
    assert abs(line.created - made.created) < 5
    assert line.getMessage().startswith("governed outcome=replayed status=201 job=0190b2c4")
    for formatter in (PlainFormatter(), JsonFormatter()):
        assert formatter.format(line).replace(formatter.formatTime(line), "") == formatter.format(
            made
        ).replace(formatter.formatTime(made), "")


def test_a_log_record_factory_of_someone_else_sees_the_request_records() -> None:
    """OpenTelemetry's logging instrumentation, for one, adds trace ids through a factory."""
    default = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        made = default(*args, **kwargs)
        made.marked = True
        return made

    logging.setLogRecordFactory(factory)
    try:
        assert getattr(_request_line(), "marked", False)
    finally:
        logging.setLogRecordFactory(default)


def test_the_plain_format_is_time_level_logger_message() -> None:
    line = _request_line()
    text = PlainFormatter().format(line)
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO idemproxy\.requests: governed outcome=replayed"
        r" status=201 job=0190b2c4-0000-7000-8000-000000000000 owner=abababab ms=[\d.]+",
        text,
    ), text


async def test_a_refused_retry_names_the_job_it_is_about(
    sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC §13: a `409 payload-mismatch` line names the job whose key was reused, as its
    answer does (SPEC §8): what an operator at 3 a.m. looks up next."""
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    async with TestServer(backend_app(Ledger())) as backend:
        settings = load_settings(upstream=str(backend.make_url("")).rstrip("/"), store=sqlite_dsn)
        async with TestClient(TestServer(create_app(settings))) as proxy:
            headers = {"Idempotency-Key": "k-reused"}
            first = await proxy.post("/pay", data=b'{"a": 1}', headers=headers)
            second = await proxy.post("/pay", data=b'{"a": 2}', headers=headers)
            assert (first.status, second.status) == (201, 409)
    ran, refused = (r.fields for r in _request_records(caplog))  # type: ignore[attr-defined]
    assert refused["outcome"] == "mismatch" and refused["job"] == ran["job"] is not None


async def test_a_fail_over_logs_the_attempt_that_answered(
    sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC §3.4, §13: the primary refuses the connection and the fallback answers: the line
    names attempt 2 and the fallback's origin together, not attempt 1 of the fallback."""
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    refused = f"http://127.0.0.1:{closed_port()}"
    async with TestServer(backend_app(Ledger())) as backend:
        fallback = str(backend.make_url("")).rstrip("/")
        routes = [{"prefix": "/", "upstream": refused, "fallbacks": [fallback]}]
        settings = load_settings(upstream=refused, store=sqlite_dsn, routes=routes)
        async with TestClient(TestServer(create_app(settings))) as proxy:
            answer = await proxy.post("/pay", data=BODY, headers={"Idempotency-Key": "k-fo"})
            assert answer.status == 201
    [line] = (r.fields for r in _request_records(caplog))  # type: ignore[attr-defined]
    assert (line["outcome"], line["attempt"], line["upstream"]) == ("new", 2, fallback)


async def test_a_hedged_race_logs_the_attempt_that_won(
    sqlite_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC §3.4, §13: the primary answers after the hedge started the fallback, which is
    slower: the line names the primary's attempt 1, which answered, not attempt 2, which
    started last."""
    caplog.set_level(logging.INFO, logger="idemproxy.requests")

    def slow(seconds: float) -> web.Application:
        async def answer(request: web.Request) -> web.Response:
            await asyncio.sleep(seconds)
            return web.json_response({"took": seconds}, status=201)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        return app

    async with TestServer(slow(0.6)) as primary, TestServer(slow(3.0)) as fallback:
        first = str(primary.make_url("")).rstrip("/")
        second = str(fallback.make_url("")).rstrip("/")
        routes = [{"prefix": "/", "upstream": first, "fallbacks": [second], "hedge_after": 0.2}]
        settings = load_settings(upstream=first, store=sqlite_dsn, routes=routes)
        async with TestClient(TestServer(create_app(settings))) as proxy:
            answer = await proxy.post("/pay", data=BODY, headers={"Idempotency-Key": "k-hedge"})
            assert answer.status == 201
    [line] = (r.fields for r in _request_records(caplog))  # type: ignore[attr-defined]
    assert (line["attempt"], line["upstream"]) == (1, first)
