"""Upstream groups with real processes: hedging through `idemproxy serve`, contract checks
through `idemproxy contract check`, and the start-up contract gate (SPEC §3.4, §13).

The upstreams are `NamedUpstream`s inside the test process (each with its own delay and body);
the one-shot commands run in a thread so that the test's event loop keeps serving them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.support.client import send
from tests.support.named_upstream import WRONG_SHAPE, NamedUpstream, write_contract

if TYPE_CHECKING:
    from .conftest import CliRun, RunCli, StartProxy

pytestmark = pytest.mark.slow

StartUpstream = Callable[..., Awaitable[NamedUpstream]]
BODY = b'{"model": "m", "prompt": "Name three idempotent HTTP methods."}'


@pytest.fixture
async def start_upstream() -> AsyncIterator[StartUpstream]:
    runners: list[web.AppRunner] = []

    async def start(name: str, **behaviour: Any) -> NamedUpstream:
        upstream = NamedUpstream(name, **behaviour)
        # handler_cancellation off (the default): a slow racer finishes even if the proxy
        # hangs up on it.
        runner = web.AppRunner(upstream.app(), access_log=None)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        upstream.url = f"http://{host}:{port}"
        return upstream

    try:
        yield start
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/hedging.db"
    pg: str = request.getfixturevalue("pg_dsn")
    return pg


async def cli(run_cli: RunCli, *args: str) -> CliRun:
    """A one-shot command, off the event loop that serves the upstreams."""
    return await asyncio.to_thread(run_cli, *args)


async def show(run_cli: RunCli, job_id: str, dsn: str) -> dict[str, Any]:
    done = await cli(run_cli, "jobs", "show", job_id, "--store", dsn, "--json")
    assert done.returncode == 0, done
    job: dict[str, Any] = json.loads(done.stdout)
    return job


async def test_hedged_request_the_fast_fallback_wins_and_the_slow_primary_is_discarded(
    dsn: str, start_upstream: StartUpstream, start_proxy: StartProxy, run_cli: RunCli
) -> None:
    a = await start_upstream("A", delay=1.0)
    b = await start_upstream("B", delay=0.1)
    proxy = await start_proxy(
        "--upstream", a.url, "--fallback", b.url, "--hedge-after", "0.2", "--store", dsn
    )
    url = f"{proxy.url}/v1/chat"
    async with aiohttp.ClientSession() as session:
        first = await send(session, url, key="hedge-e2e", body=BODY)
        assert first.status == 200, proxy.describe()
        assert json.loads(first.body)["upstream"] == "B"
        assert not first.replayed
        assert first.done_at - first.sent_at < 0.9, "the client waited for the slow primary"
        job_id = first.job
        assert job_id is not None
        # Both upstreams got the request (that is hedging), under the same job.
        assert (a.count("hedge-e2e"), b.count("hedge-e2e")) == (1, 1)
        assert [e.header("Idempotency-Attempt") for e in a.received + b.received] == ["1", "2"]
        assert {e.header("Idempotency-Job") for e in a.received + b.received} == {job_id}

        while_racing = await send(session, url, key="hedge-e2e", body=BODY)
        assert (while_racing.status, while_racing.body) == (200, first.body)
        assert while_racing.replayed

        deadline = time.monotonic() + 10
        while len(a.finished) < 1:  # A answers after 1.0 s; its result must lose the CAS
            assert time.monotonic() < deadline, proxy.describe()
            await asyncio.sleep(0.05)
        while True:
            job = await show(run_cli, job_id, dsn)
            if all(attempt["state"] != "started" for attempt in job["attempts"]):
                break
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.1)

        after = await send(session, url, key="hedge-e2e", body=BODY)
    assert (after.status, after.body, after.replayed) == (200, first.body, True)
    assert (job["state"], job["completed_by"], job["response_status"]) == ("completed", 2, 200)
    attempts = [(x["number"], x["upstream"], x["state"], x["status"]) for x in job["attempts"]]
    assert attempts == [(1, a.url, "discarded", 200), (2, b.url, "succeeded", 200)]
    assert all(x["finished_at"] for x in job["attempts"])
    assert (a.count(), b.count()) == (1, 1)  # retries never executed again


def contract_config(tmp_path: Path, primary: str, fallbacks: list[str], **extra: Any) -> Path:
    contract = write_contract(tmp_path, samples=2) | {"interval": 0, "timeout": 5}
    route = {"prefix": "/v1", "upstream": primary, "fallbacks": fallbacks, "contract": contract}
    path = tmp_path / "group.yaml"
    path.write_text(yaml.safe_dump({"routes": [route], **extra}))
    return path


async def test_contract_check_passes_when_every_upstream_complies(
    tmp_path: Path, start_upstream: StartUpstream, run_cli: RunCli
) -> None:
    primary = await start_upstream("primary")
    fallback = await start_upstream("fallback")
    config = contract_config(tmp_path, primary.url, [fallback.url])

    done = await cli(run_cli, "contract", "check", "--config", str(config))
    assert done.returncode == 0, done
    assert "route /v1 (2 samples)" in done.stdout
    assert f"ok   {primary.url}" in done.stdout
    assert f"ok   {fallback.url}" in done.stdout
    assert "FAIL" not in done.stdout
    # Every upstream of the group, the primary included, answered every sample.
    assert (primary.samples, fallback.samples) == (2, 2)


async def test_contract_check_names_the_violating_upstream_and_sample(
    tmp_path: Path, start_upstream: StartUpstream, run_cli: RunCli
) -> None:
    primary = await start_upstream("primary")
    wrong = await start_upstream("wrong", document=WRONG_SHAPE)
    erring = await start_upstream("erring", status=404)  # proves nothing about the contract
    good = await start_upstream("good")
    config = contract_config(tmp_path, primary.url, [wrong.url, erring.url, good.url])

    done = await cli(run_cli, "contract", "check", "--config", str(config), "--route", "/v1")
    assert done.returncode == 1, done
    lines = done.stdout.splitlines()
    assert f"  FAIL {wrong.url}" in lines, done.stdout
    assert f"  FAIL {erring.url}" in lines
    assert f"  ok   {primary.url}" in lines
    assert f"  ok   {good.url}" in lines
    # Each violation names its sample and what is wrong with the answer.
    problems = [line.strip() for line in lines if line.strip().startswith("sample ")]
    assert "sample 1: /: 'id' is a required property" in problems, done.stdout
    assert "sample 2: /: 'choices' is a required property" in problems
    assert "sample 1: answered 404, not a 2xx response" in problems
    assert "Traceback" not in done.stderr


async def test_contract_check_reports_an_upstream_that_does_not_answer(
    tmp_path: Path, start_upstream: StartUpstream, run_cli: RunCli
) -> None:
    primary = await start_upstream("primary")
    config = contract_config(tmp_path, primary.url, ["http://127.0.0.1:9"])
    done = await cli(run_cli, "contract", "check", "--config", str(config))
    assert done.returncode == 1, done
    assert "  FAIL http://127.0.0.1:9" in done.stdout
    assert "sample 1: no answer" in done.stdout


async def test_contract_check_without_a_matching_route_fails(
    tmp_path: Path, start_upstream: StartUpstream, run_cli: RunCli
) -> None:
    primary = await start_upstream("primary")
    config = contract_config(tmp_path, primary.url, [])
    done = await cli(run_cli, "contract", "check", "--config", str(config), "--route", "/v2")
    assert done.returncode == 1, done
    assert "no route with a contract at /v2" in done.stdout
    assert primary.samples == 0


async def test_serve_checks_the_fallbacks_at_start_up_and_skips_a_violating_one(
    tmp_path: Path, start_upstream: StartUpstream, start_proxy: StartProxy
) -> None:
    primary = await start_upstream("primary", status=503)
    wrong = await start_upstream("wrong", document=WRONG_SHAPE)
    good = await start_upstream("good")
    config = contract_config(
        tmp_path, primary.url, [wrong.url, good.url], store=f"sqlite:///{tmp_path}/gate.db"
    )
    proxy = await start_proxy("--config", str(config))
    assert (wrong.samples, good.samples) == (2, 2)  # checked before the port opened
    async with aiohttp.ClientSession() as session:
        answer = await send(session, f"{proxy.url}/v1/chat", key="gate-e2e", body=BODY)
    assert answer.status == 200, proxy.describe()
    assert json.loads(answer.body)["upstream"] == "good"
    assert wrong.count("gate-e2e") == 0
    # The log line is written by the proxy's log writer thread: it may reach the pipe a moment
    # after the answer does.
    deadline = time.monotonic() + 5.0
    while f"fallback {wrong.url} is not eligible" not in proxy.stderr() + proxy.stdout():
        assert time.monotonic() < deadline, proxy.describe()
        await asyncio.sleep(0.05)


async def test_contract_check_with_an_invalid_schema_names_the_field(
    tmp_path: Path, start_upstream: StartUpstream, run_cli: RunCli
) -> None:
    primary = await start_upstream("primary")
    config = contract_config(tmp_path, primary.url, [])
    (tmp_path / "chat.schema.json").write_text('{"type": 12}')
    done = await cli(run_cli, "contract", "check", "--config", str(config))
    assert done.returncode == 2, done
    assert "invalid configuration: contract.schema_file" in done.stderr
    assert "Traceback" not in done.stderr
    assert primary.samples == 0
