"""End to end: the batch runner → the real proxy (`idemproxy serve`) → a paid endpoint.

The promise of SPEC §14, checked on the charges: a batch killed with SIGKILL at ~80% and rerun
ends with exactly one result and exactly one charge per item; connections reset after the
request went through cost nothing extra; a torn last line is repaired; an edited item is
reported, not silently replayed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from idemproxy.batch import BatchOptions, run_batch

from .paid import Charges
from .rawserver import RawAnswer, RawUpstream, raw_upstream
from .relay import resetting_relay
from .servers import (
    charge_items,
    line_count,
    read_results,
    start_proxy,
    stop_process,
    write_jsonl,
)
from .test_hostile import strict_results

pytestmark = pytest.mark.slow

SECRET = "Bearer sk-test-never-written"


async def _cli(
    *args: str, log: Path, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    with log.open("ab") as sink:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "idemproxy", "batch", *args,
            stdout=sink, stderr=sink, env={**os.environ, **(env or {})},
        )  # fmt: skip


def _run_args(source: Path, out: Path, target: str, *extra: str) -> tuple[str, ...]:
    return ("run", str(source), "--target", target, "--output", str(out), *extra)


async def _signal_at(
    process: asyncio.subprocess.Process, out: Path, lines: int, signum: int
) -> int:
    """Signal the run once the results file holds `lines` lines; the count at that moment."""
    while process.returncode is None:
        written = line_count(out)
        if written >= lines:
            process.send_signal(signum)
            return written
        await asyncio.sleep(0.005)  # another process writes the file: polling is all there is
    raise AssertionError(f"the run ended before it was signalled (exit {process.returncode})")


def _options(target: str, **overrides: Any) -> BatchOptions:
    return BatchOptions(
        **{
            "target": target,
            "concurrency": 4,
            "backoff_base": 0.01,
            "backoff_max": 0.1,
            **overrides,
        }
    )


async def test_killed_at_80_percent_and_rerun_pays_exactly_once_per_item(
    proxy_url: str, charges: Charges, tmp_path: Path
) -> None:
    charges.delay = 0.04
    source = write_jsonl(tmp_path / "in.jsonl", charge_items(300))
    out, log = tmp_path / "out.jsonl", tmp_path / "batch.log"
    args = _run_args(source, out, proxy_url, "--concurrency", "8", "--header-env",
                     "Authorization=BATCH_TEST_AUTH")  # fmt: skip
    env = {"BATCH_TEST_AUTH": SECRET}

    first = await _cli(*args, log=log, env=env)
    written = await _signal_at(first, out, 240, signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL and written < 300

    status = await _status(out, source, tmp_path)
    assert status["items"] == 300 and status["pending"] == 300 - status["done"]

    second = await _cli(*args, log=log, env=env)
    assert await second.wait() == 0, log.read_text()

    results = read_results(out)
    assert sorted(r["id"] for r in results) == [f"item-{n:04d}" for n in range(300)]
    assert all(r["outcome"] == "done" for r in results)
    assert charges.total == 300 and charges.doubled() == []
    # The items in flight at the kill were executed once, and replayed on resume.
    assert any(r["replayed"] for r in results[written:])
    assert SECRET not in out.read_text()


async def test_ctrl_c_stops_cleanly_with_a_result_for_every_charge(
    proxy_url: str, charges: Charges, tmp_path: Path
) -> None:
    charges.delay = 0.04
    source = write_jsonl(tmp_path / "in.jsonl", charge_items(150))
    out, log = tmp_path / "out.jsonl", tmp_path / "batch.log"
    args = _run_args(source, out, proxy_url, "--concurrency", "8")

    first = await _cli(*args, log=log)
    await _signal_at(first, out, 50, signal.SIGINT)
    assert await first.wait() == 130, log.read_text()
    assert "stopping: finishing the items in flight" in log.read_text()
    data = out.read_bytes()
    assert data.endswith(b"\n")  # no torn line: the items in flight finished and were written
    assert charges.total == len(data.splitlines()) < 150  # nothing was paid without its result

    second = await _cli(*args, log=log)
    assert await second.wait() == 0, log.read_text()
    assert len(read_results(out)) == 150 and charges.total == 150 and not charges.doubled()


async def _status(out: Path, source: Path, tmp_path: Path) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idemproxy", "batch", "status", str(out), "--input", str(source),
        "--json", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, _ = await process.communicate()
    assert process.returncode == 0
    status: dict[str, Any] = json.loads(stdout)
    return status


async def test_connections_reset_mid_way_cost_no_second_charge(
    proxy_url: str, charges: Charges, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    async with resetting_relay(proxy_url, reset={2, 3, 6}) as (relay, relay_url):
        summary = await run_batch(charge_items(60), out, _options(relay_url))
    assert relay.resets == 3
    results = read_results(out)
    assert len(results) == 60 and all(r["outcome"] == "done" for r in results)
    # Each reset came after the request went through: the retry's replay answers the execution
    # this run started, and counts as executed, not as a free replay (SPEC §14).
    assert summary.complete and summary.answered_late >= 1 and summary.replayed == 0
    retried = [r for r in results if r["attempts"] > 1]
    assert retried and all(r["replayed"] and r["sent_before"] for r in retried)
    assert charges.total == 60 and charges.doubled() == []


async def test_a_torn_last_line_is_repaired_and_its_item_replayed(
    proxy_url: str, charges: Charges, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    items = charge_items(20)
    await run_batch(items, out, _options(proxy_url))
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 25])  # the process died writing the last line
    torn_id = json.loads(data.splitlines()[-1])["id"]

    summary = await run_batch(items, out, _options(proxy_url))
    assert summary.torn is not None and summary.torn.line == 20
    assert (summary.skipped, summary.done, summary.replayed) == (19, 1, 1)
    results = read_results(out)
    assert len(results) == 20 and results[-1]["id"] == torn_id and results[-1]["replayed"]
    assert charges.total == 20 and charges.doubled() == []


async def test_a_changed_payload_is_reported_not_silently_replayed(
    proxy_url: str, charges: Charges, tmp_path: Path
) -> None:
    out, log = tmp_path / "out.jsonl", tmp_path / "batch.log"
    items = charge_items(10)
    await run_batch(items, out, _options(proxy_url))
    items[3]["body"] = {"amount": 400}  # edited after it was paid
    source = write_jsonl(tmp_path / "in.jsonl", items)

    rerun = await _cli(*_run_args(source, out, proxy_url), log=log)
    assert await rerun.wait() == 1
    assert "item 'item-0003' (line 4) changed since its result was written" in log.read_text()
    assert charges.total == 10 and len(read_results(out)) == 10
    assert (await _status(out, source, tmp_path))["changed"] == 1

    again = await _cli(*_run_args(source, out, proxy_url, "--rerun-changed"), log=log)
    assert await again.wait() == 0, log.read_text()
    assert charges.total == 11 and charges.doubled() == []  # a new intent, paid once
    latest = [r for r in read_results(out) if r["id"] == "item-0003"][-1]
    assert latest["body"]["echo"] == {"amount": 400} and not latest["replayed"]
    assert (await _status(out, source, tmp_path))["changed"] == 0


STORED_LIMIT = 1024  # the proxy's max_stored_body in the tests below
JSON = b"Content-Type: application/json"


@pytest.fixture
async def raw_proxy(tmp_path: Path) -> AsyncIterator[tuple[RawUpstream, str]]:
    """The real proxy in front of the raw upstream, keeping bodies up to STORED_LIMIT bytes."""
    async with raw_upstream(RawUpstream()) as (upstream, upstream_url):
        env = {"IDEMPROXY_MAX_STORED_BODY": str(STORED_LIMIT)}
        process, url = await start_proxy(upstream_url, tmp_path, env)
        try:
            yield upstream, url
        finally:
            await stop_process(process)


async def test_a_body_python_cannot_write_back_does_not_stop_the_batch(
    raw_proxy: tuple[RawUpstream, str], tmp_path: Path
) -> None:
    upstream, url = raw_proxy
    upstream.answers.update(
        {f"/ok{n}": RawAnswer(201, (JSON,), b'{"n": %d}' % n) for n in range(6)}
        | {
            "/cut-emoji": RawAnswer(201, (JSON,), b'{"text":"caf\\ud83d"}'),
            "/deep": RawAnswer(200, (JSON,), b"[" * 100_000 + b"]" * 100_000),
        }
    )
    paths = ["/ok0", "/cut-emoji", "/ok1", "/ok2", "/deep", "/ok3", "/ok4", "/ok5"]
    source = write_jsonl(
        tmp_path / "in.jsonl", [{"id": p[1:], "method": "POST", "path": p} for p in paths]
    )
    out, log = tmp_path / "out.jsonl", tmp_path / "batch.log"
    for _ in range(2):  # and a rerun finds everything answered
        run = await _cli(*_run_args(source, out, url, "--concurrency", "2"), log=log)
        assert await run.wait() == 0, log.read_text()
    results = {r["id"]: r for r in strict_results(out)}
    assert len(results) == len(paths) and all(r["outcome"] == "done" for r in results.values())
    assert results["cut-emoji"]["body"] == '{"text":"caf\\ud83d"}'
    assert results["cut-emoji"]["body_encoding"] == "text"
    assert set(upstream.executions.values()) == {1} and len(upstream.executions) == len(paths)
    assert "Traceback" not in log.read_text()


async def test_an_answer_the_proxy_did_not_store_is_omitted_not_done(
    raw_proxy: tuple[RawUpstream, str], tmp_path: Path
) -> None:
    upstream, url = raw_proxy
    big = b'{"pad": "%s"}' % (b"x" * 4 * STORED_LIMIT)
    upstream.answers["/small"] = RawAnswer(201, (JSON,), b'{"ok": true}', delay=1.0)
    upstream.answers["/big"] = RawAnswer(201, (JSON,), big, delay=1.0)
    items = [{"id": p[1:], "method": "POST", "path": p} for p in ("/small", "/big")]
    out = tmp_path / "out.jsonl"
    # Each first try times out; the proxy finishes the call and the retry is its replay.
    summary = await run_batch(items, out, _options(url, timeout=0.5))
    results = {r["id"]: r for r in read_results(out)}
    assert results["small"]["outcome"] == "done" and results["small"]["body"] == {"ok": True}
    assert results["big"]["outcome"] == "omitted" and results["big"]["body"] is None
    assert results["big"]["status"] == 201 and results["big"]["replayed"]
    assert (summary.done, summary.omitted, summary.complete) == (1, 1, False)
    source = write_jsonl(tmp_path / "in.jsonl", items)
    status = await _status(out, source, tmp_path)
    assert (status["done"], status["omitted"], status["pending"]) == (1, 1, 0)

    log = tmp_path / "batch.log"
    rerun = await _cli(*_run_args(source, out, url), log=log)
    assert await rerun.wait() == 1, log.read_text()  # not complete: the body is gone
    assert "omitted 1 (executed once" in log.read_text()
    assert len(read_results(out)) == 2  # nothing was sent again
    assert upstream.executions == {"/small": 1, "/big": 1}


async def test_a_409_the_proxy_stored_is_final(
    raw_proxy: tuple[RawUpstream, str], tmp_path: Path
) -> None:
    upstream, url = raw_proxy
    upstream.answers["/taken"] = RawAnswer(409, (JSON,), b'{"error": "name taken"}')
    items = [{"id": "taken", "method": "POST", "path": "/taken"}]
    out = tmp_path / "out.jsonl"
    summary = await run_batch(items, out, _options(url))
    [result] = read_results(out)
    assert result["outcome"] == "failed" and not result["retryable"]
    assert result["attempts"] == 2 and result["replayed"]  # the retry got the stored answer
    assert summary.retryable == 0
    again = await run_batch(items, out, _options(url))
    assert again.sent == 0 and upstream.executions == {"/taken": 1}


async def test_the_proxys_retry_advice_decides_not_the_status(tmp_path: Path) -> None:
    """SPEC §8: a 504 upstream-timeout says `retry: never`; the runner records the item
    `unknown` at once instead of retrying it as a 504 would be (and being told so)."""
    async with raw_upstream(RawUpstream()) as (upstream, upstream_url):
        upstream.answers["/slow"] = RawAnswer(201, (JSON,), b"{}", delay=3.0)
        env = {"IDEMPROXY_UPSTREAM_TIMEOUT": "0.3"}
        process, url = await start_proxy(upstream_url, tmp_path, env)
        try:
            items = [{"id": "slow", "method": "POST", "path": "/slow"}]
            out = tmp_path / "out.jsonl"
            summary = await run_batch(items, out, _options(url))
        finally:
            await stop_process(process)
    [result] = read_results(out)
    assert result["outcome"] == "unknown" and result["status"] == 504, result
    assert result["attempts"] == 1, result
    assert summary.unknown == 1
