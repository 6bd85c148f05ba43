"""End to end against a fake paid LLM API behind the real proxy: the usage ledger, the budget
stop and the rate limits (SPEC §14, docs/batch.md).

The API (llm.py) reports usage as OpenAI and Anthropic do, bills every execution per key, and
answers real 429s past its request and token limits. What must hold: a run killed with
SIGKILL and resumed totals exactly the tokens billed, each item once, replays apart; a budget
stop ends with exit 3 within the limit and a higher limit resumes; a 429 pauses every worker
for what it asks; `--rpm`/`--tpm` keep a run under the limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from idemproxy.batch import BatchOptions, run_batch

from .llm import PRICES_YAML, LlmApi, llm_app, llm_items, usage_of
from .servers import line_count, read_results, start_app, start_proxy, stop_process, write_jsonl

pytestmark = pytest.mark.slow

RATES = {"gpt-4o-mini": (Decimal("0.15"), Decimal("0.60")),
         "claude-3-5-haiku": (Decimal("0.80"), Decimal("4.00"))}  # fmt: skip


@contextlib.asynccontextmanager
async def llm_behind_proxy(
    api: LlmApi, folder: Path, env: dict[str, str] | None = None
) -> AsyncIterator[str]:
    """`api` behind `idemproxy serve` (`env`: its environment's additions); the proxy's URL."""
    folder.mkdir(exist_ok=True)  # noqa: ASYNC240 - a test's own temporary folder
    runner, url = await start_app(llm_app(api))
    try:
        process, proxy_url = await start_proxy(url, folder, env)
        try:
            yield proxy_url
        finally:
            await stop_process(process)
    finally:
        await runner.cleanup()


async def _cli(*args: str, log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as sink:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "idemproxy", "batch", *args, stdout=sink, stderr=sink
        )


async def _status(*args: str) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idemproxy", "batch", "status", *args, "--json",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, _ = await process.communicate()
    assert process.returncode == 0
    status: dict[str, Any] = json.loads(stdout)
    return status


def _expected(items: list[dict[str, Any]]) -> tuple[int, Decimal]:
    """The tokens and the cost of executing every item once, from the API's own rule."""
    tokens, cost = 0, Decimal(0)
    for item in items:
        used_in, used_out = usage_of(item["body"])
        rate_in, rate_out = RATES[item["body"]["model"]]
        tokens += used_in + used_out
        cost += (used_in * rate_in + used_out * rate_out) / 1_000_000
    return tokens, cost


def _options(target: str, **overrides: Any) -> BatchOptions:
    values = {"target": target, "concurrency": 8, "backoff_base": 0.01, "backoff_max": 0.1}
    return BatchOptions(**{**values, **overrides})


async def test_a_killed_and_resumed_run_counts_every_token_once_and_replays_apart(
    tmp_path: Path,
) -> None:
    api = LlmApi(delay=0.05)
    items = llm_items(120)
    source = write_jsonl(tmp_path / "in.jsonl", items)
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES_YAML)
    out, log = tmp_path / "out.jsonl", tmp_path / "batch.log"
    async with llm_behind_proxy(api, tmp_path) as url:
        args = ("run", str(source), "--target", url, "--output", str(out), "--concurrency", "8",
                "--prices", str(prices))  # fmt: skip
        first = await _cli(*args, log=log)
        while line_count(out) < 60 and first.returncode is None:  # noqa: ASYNC110
            await asyncio.sleep(0.005)  # another process writes the file: polling is all there is
        first.send_signal(signal.SIGKILL)
        assert await first.wait() == -signal.SIGKILL
        written = line_count(out)
        assert written < 120
        second = await _cli(*args, log=log)
        assert await second.wait() == 0, log.read_text()

    results = read_results(out)
    assert len(results) == 120 and all(r["outcome"] == "done" for r in results)
    assert set(api.executions.values()) == {1} and len(api.executions) == 120
    tokens, cost = _expected(items)
    assert api.billed_tokens == tokens
    for result in results:
        assert result["usage"]["total_tokens"] == api.billed[result["key"]]
    replayed = [r for r in results if r["replayed"]]
    assert replayed and all(r in results[written:] for r in replayed)  # in flight at the kill

    status = await _status(str(out), "--input", str(source), "--prices", str(prices))
    usage = status["usage"]
    assert usage["total_tokens"] == tokens and usage["cost"] == float(cost)
    assert usage["replayed"]["answers"] == len(replayed)
    assert usage["replayed"]["total_tokens"] == sum(api.billed[r["key"]] for r in replayed)
    assert usage["executed"]["answers"] == 120 - len(replayed)
    assert usage["unpriced_models"] == [] and usage["unmetered"] == 0
    last_run = status["last_run_usage"]  # the resumed run alone
    assert last_run["replayed"]["answers"] == len(replayed)
    assert last_run["executed"]["answers"] == 120 - written - len(replayed)
    assert last_run["total_tokens"] == sum(api.billed[r["key"]] for r in results[written:])
    assert status["last_run"] == results[-1]["run"] != results[0]["run"]
    text = log.read_text()
    assert "results file: executed" in text and "paid once, by the run that executed them" in text
    assert f"replayed {len(replayed)} answer(s)" in text and "cost nothing now" in text


async def test_a_budget_stop_ends_cleanly_within_the_limit_and_a_higher_limit_resumes(
    tmp_path: Path,
) -> None:
    api = LlmApi(delay=0.02)
    items = llm_items(60)
    source = write_jsonl(tmp_path / "in.jsonl", items)
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES_YAML)
    out, log = tmp_path / "out.jsonl", tmp_path / "batch.log"
    async with llm_behind_proxy(api, tmp_path) as url:
        base = ("run", str(source), "--target", url, "--output", str(out), "--concurrency", "4")
        stopped = await _cli(*base, "--max-tokens", "600", log=log)
        assert await stopped.wait() == 3, log.read_text()
        status = await _status(str(out), "--input", str(source))
        assert 0 < status["done"] < 60 and status["pending"] == 60 - status["done"]
        assert status["usage"]["total_tokens"] <= 600
        assert api.billed_tokens == status["usage"]["total_tokens"]
        text = log.read_text()
        assert "budget reached, --max-tokens 600: spent" in text
        assert f"{status['done']} of 60 items done, {60 - status['done']} not started" in text

        priced = (*base, "--prices", str(prices))
        spent = (await _status(str(out), "--prices", str(prices)))["usage"]["cost"]
        limit = f"{Decimal(str(spent)) + Decimal('0.0004'):.7f}"
        by_cost = await _cli(*priced, "--max-cost", limit, log=log)
        assert await by_cost.wait() == 3, log.read_text()
        later = await _status(str(out), "--prices", str(prices))
        assert later["usage"]["cost"] <= float(limit)
        assert status["done"] < later["done"] < 60
        assert f"budget reached, --max-cost {limit}" in log.read_text()

        resumed = await _cli(*priced, "--max-cost", "1", log=log)
        assert await resumed.wait() == 0, log.read_text()
    assert len(read_results(out)) == 60 and set(api.executions.values()) == {1}
    tokens, _ = _expected(items)
    assert (await _status(str(out)))["usage"]["total_tokens"] == tokens == api.billed_tokens


def _quiet_after_each_refusal(api: LlmApi, margin: float) -> None:
    """No request reached the API while a refusal's wait ran (those in flight aside)."""
    for when, asked in api.refusals:
        during = [t for t in api.arrivals if when + margin < t < when + asked - margin]
        assert during == [], (when, asked, during)


@contextlib.asynccontextmanager
async def llm_alone(api: LlmApi) -> AsyncIterator[str]:
    """The API without the proxy: what reaches it is what the runner sent, when it sent it."""
    runner, url = await start_app(llm_app(api))
    try:
        yield url
    finally:
        await runner.cleanup()


async def test_a_429_pauses_every_worker_for_its_retry_after(tmp_path: Path) -> None:
    api = LlmApi(requests=5, window=1.0)
    items = llm_items(16)
    out = tmp_path / "out.jsonl"
    async with llm_alone(api) as url:
        summary = await run_batch(items, out, _options(url))
    assert summary.complete and summary.rate_limit_pauses >= 1
    assert api.refusals and set(api.executions.values()) == {1} and len(api.executions) == 16
    _quiet_after_each_refusal(api, margin=0.1)
    assert "rate limited:" in summary.describe()


async def test_x_ratelimit_reset_durations_pause_the_run(tmp_path: Path) -> None:
    api = LlmApi(requests=4, window=2.0, reset_headers=True)
    items = llm_items(10)
    out = tmp_path / "out.jsonl"
    async with llm_alone(api) as url:
        summary = await run_batch(items, out, _options(url))
    assert summary.complete and api.refusals
    assert all(0 < asked <= 2.0 for _, asked in api.refusals)  # in milliseconds, as asked
    _quiet_after_each_refusal(api, margin=0.1)
    assert set(api.executions.values()) == {1}


async def test_rpm_and_tpm_keep_a_run_under_the_limits(tmp_path: Path) -> None:
    items = llm_items(30, max_tokens=400)  # each reserves ~420 tokens, uses ~25
    limits = {"requests": 20, "tokens": 2000, "window": 1.0}
    unlimited = LlmApi(**limits, delay=0.05)  # type: ignore[arg-type]
    async with llm_behind_proxy(unlimited, tmp_path / "a") as url:
        control = await run_batch(items, tmp_path / "a.jsonl", _options(url))
    # The limits bite without --rpm/--tpm, and the proxy passes the 429s on as they came.
    assert unlimited.refusals and control.rate_limit_pauses > 0

    api = LlmApi(**limits, delay=0.05)  # type: ignore[arg-type]
    async with llm_behind_proxy(api, tmp_path / "b") as url:
        options = _options(url, rpm=0.7 * 20 * 60, tpm=0.7 * 2000 * 60)
        summary = await run_batch(items, tmp_path / "b.jsonl", options)
    assert summary.complete and api.refusals == [] and summary.rate_limit_pauses == 0
    assert set(api.executions.values()) == {1} and len(api.executions) == 30
