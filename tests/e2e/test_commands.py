"""The one-shot commands and a store without its schema (SPEC §11, §13)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from tests.support.client import send

if TYPE_CHECKING:
    from .conftest import Backend, RunCli, StartProxy

pytestmark = pytest.mark.slow

FIRST_MIGRATION = "0001_jobs_and_attempts"


def _migrate_twice(run_cli: RunCli, store: str) -> None:
    first = run_cli("migrate", "--store", store)
    assert first.returncode == 0, first
    assert first.stdout.strip().startswith("applied ")
    assert FIRST_MIGRATION in first.stdout
    again = run_cli("migrate", "--store", store)
    assert again.returncode == 0, again
    assert again.stdout.strip() == "applied 0 migration(s)"


@pytest.mark.postgres
def test_migrate_a_fresh_postgres_database_once(empty_pg_dsn: str, run_cli: RunCli) -> None:
    _migrate_twice(run_cli, empty_pg_dsn)


def test_migrate_a_fresh_sqlite_file_once(tmp_path: Path, run_cli: RunCli) -> None:
    path = tmp_path / "idemproxy.db"
    _migrate_twice(run_cli, f"sqlite:///{path}")
    assert path.is_file()


def test_the_default_store_is_created_in_the_working_directory(
    tmp_path: Path, run_cli: RunCli
) -> None:
    done = run_cli("migrate", timeout=20)
    assert done.returncode == 0, done
    assert (tmp_path / "idemproxy.db").is_file()


@pytest.mark.parametrize("command", [("migrate",), ("jobs", "list")])
def test_a_missing_sqlite_directory_is_an_error_naming_the_resolved_path(
    tmp_path: Path, run_cli: RunCli, command: tuple[str, ...]
) -> None:
    done = run_cli(*command, "--store", "sqlite:///new/idemproxy.db", timeout=20)
    assert done.returncode != 0, done
    [line] = done.stderr.splitlines()
    assert str(tmp_path / "new" / "idemproxy.db") in line, done.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "command", [("migrate",), ("jobs", "list"), ("serve", "--upstream", "http://127.0.0.1:9")]
)
def test_an_unreachable_store_is_one_line_naming_the_server(
    run_cli: RunCli, command: tuple[str, ...]
) -> None:
    # Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    dsn = "postgresql://nobody:s3cret@127.0.0.1:9/orders"
    # serve would wait for the server (test_store_start.py): not here.
    done = run_cli(
        *command, "--store", dsn, env={"IDEMPROXY_STORE_START__MAX_WAIT": "0"}, timeout=20
    )
    assert done.returncode == 1, done
    lines = [line for line in done.stderr.splitlines() if "INFO" not in line]
    assert lines == [
        "idemproxy: cannot reach PostgreSQL at 127.0.0.1:9/orders: connection refused"
    ], done.stderr
    assert "not forwarded" not in done.stderr
    assert "s3cret" not in done.stderr


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"])
def unmigrated_dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/empty.db"
    dsn: str = request.getfixturevalue("empty_pg_dsn")
    return dsn


async def test_serve_without_migrations_fails_closed(
    unmigrated_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy("--upstream", backend.url, "--store", unmigrated_dsn, "--no-migrate")
    async with aiohttp.ClientSession() as session:
        for _ in range(2):  # still answering after the first failure
            answer = await send(session, f"{proxy.url}/payments", key="k-1")
            assert (answer.status, answer.error) == (503, "store-unavailable"), proxy.describe()
            assert answer.headers["Retry-After"].isdigit()
            assert answer.headers["Content-Type"].startswith("application/problem+json")
            problem = json.loads(answer.body)
            assert problem["code"] == "store-unavailable"
            # SPEC §8: no SQL or driver text reaches the client.
            assert "jobs" not in problem["detail"]
            assert "relation" not in answer.body.decode()
        # SPEC §11: governed requests are not forwarded when the store fails ...
        assert backend.ledger.count() == 0
        # ... while requests without a key still pass through.
        passthrough = await send(session, f"{proxy.url}/payments")
        assert passthrough.status == 201
    assert backend.ledger.count() == 1
    assert proxy.running
    assert await proxy.terminate() == 0, proxy.describe()


def test_demo_shows_one_execution_per_intent(run_cli: RunCli) -> None:
    done = run_cli("demo")
    assert done.returncode == 0, done
    assert "The backend charged 3 time(s) for 3 intents" in done.stdout, done.stdout
    # SPEC §3.6: the timeout resolved itself: 504, 409 while unknown, then its response.
    assert "first try    → 504 upstream-timeout" in done.stdout, done.stdout
    assert "retry        → 409 outcome-unknown, Retry-After:" in done.stdout, done.stdout
    assert "retry        → 201 pay_3 (replayed)" in done.stdout, done.stdout
    # A newcomer's first run reads as the story it tells: no operator's warning breaks in.
    assert "WARNING" not in done.stdout + done.stderr, done.stderr


def test_webhooks_demo_shows_one_execution_per_event(run_cli: RunCli) -> None:
    done = run_cli("demo", "--webhooks")
    assert done.returncode == 0, done
    assert "The receiver executed 3 time(s) for 3 events" in done.stdout, done.stdout
    assert "401 signature-invalid" in done.stdout, done.stdout
    assert done.stdout.count("(replayed)") == 7, done.stdout


async def test_serve_on_a_store_in_memory_warns_that_a_restart_forgets_every_job(
    start_proxy: StartProxy, backend: Backend
) -> None:
    proxy = await start_proxy("--upstream", backend.url, "--store", "sqlite:///:memory:")
    assert "a restart forgets every one" in proxy.stderr()
    assert "a retry of a key that executed before it executes again" in proxy.stderr()
