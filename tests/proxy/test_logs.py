"""Structured request logs (SPEC §13): job id, attempt, owner hash prefix and outcome on every
governed request; never a body, a credential or a key's header value beyond the key itself."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from backend import Ledger, backend_app
from idemproxy.config import load_settings
from idemproxy.logs import JsonFormatter, configure_logging
from idemproxy.owner import hash_credential
from idemproxy.proxy.app import create_app

SECRET = "Bearer s3cr3t-token"
BODY = b'{"card": "4111111111111111"}'


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """`configure_logging` changes process-wide state: put it back for the other tests."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers), logging.getLogger("aiosqlite").level)
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    logging.getLogger("aiosqlite").setLevel(saved[2])


async def _exchange(sqlite_dsn: str, **overrides: object) -> None:
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
