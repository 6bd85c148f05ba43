"""Items sent whose answer did not come back, against a fake paid LLM API behind the real proxy
(SPEC §14, docs/batch.md: *Tokens, money and the budget*).

An item whose request went out and whose answer never came (the runner's `--timeout`, a
connection lost after sending, the proxy's `outcome-unknown`) may have executed and been paid:
its worst case stays counted against the budget, in the run and in the results file, until an
answer for its key says what it used. And when that answer is a replay of the execution this
batch's own try started, it was paid by this batch: executed, not a free replay.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from idemproxy.batch import BatchOptions, run_batch
from idemproxy.batch.input import item_from_object
from idemproxy.batch.usage import worst_case

from .llm import LlmApi, llm_items
from .servers import read_results, write_jsonl
from .test_llm import _status, llm_behind_proxy

pytestmark = pytest.mark.slow


async def _cli(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idemproxy", "batch", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, output.decode()


async def _until_idle(api: LlmApi) -> None:
    """Wait for the executions the proxy carries on after the runner gave up (SPEC §2)."""
    for _ in range(400):
        await asyncio.sleep(0.025)
        if api.in_flight == 0:
            return
    raise AssertionError("the upstream never finished")


def _two_fit(items: list[dict[str, Any]]) -> int:
    worst = [
        int(worst_case(item_from_object(item, n), None).to_json()["total_tokens"])
        for n, item in enumerate(items, 1)
    ]
    limit = 2 * max(worst) + 1  # room for any two items at their worst, never for three
    assert 3 * min(worst) > limit
    return limit


async def test_items_sent_without_an_answer_keep_their_worst_case_and_the_run_stops(
    tmp_path: Path,
) -> None:
    # The run: six items, a budget with room for two, an upstream that answers after
    # the runner's --timeout. Each try times out, the retries find the key still in flight, and
    # the item ends `failed` with no usage: before the fix its reservation was dropped and every
    # item executed and was paid, and the run exited 1.
    api = LlmApi(delay=3.0)  # long after the retry too, however slow the machine
    items = llm_items(6, max_tokens=10)
    limit = _two_fit(items)
    source, out = write_jsonl(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    async with llm_behind_proxy(api, tmp_path / "proxy") as url:
        args = ("run", str(source), "--target", url, "--output", str(out), "--concurrency", "4",
                "--max-tokens", str(limit), "--retries", "1")  # fmt: skip
        status, log = await _cli(*args, "--timeout", "0.3")
        await _until_idle(api)
        assert status == 3, log
        assert len(api.executions) == 2 and api.billed_tokens <= limit
        results = read_results(out)
        assert [r["outcome"] for r in results] == ["failed", "failed"]
        assert all(r["worst_case"]["total_tokens"] > 0 and r["usage"] is None for r in results)
        assert "in doubt 2 item(s)" in log and f"budget reached, --max-tokens {limit:,}" in log

        report = await _status(str(out), "--input", str(source))
        assert report["usage"]["in_doubt"]["items"] == 2
        in_doubt = sum(r["worst_case"]["total_tokens"] for r in results)
        assert report["usage"]["in_doubt"]["total_tokens"] == in_doubt

        # The resume counts them too, and their replays settle them to what they used: room
        # comes back, and the budget still holds over the whole file.
        api.delay = 0.01
        status, log = await _cli(*args, "--timeout", "30")
        assert status in (0, 3), log
    report = await _status(str(out), "--input", str(source))
    usage = report["usage"]
    assert usage["in_doubt"]["items"] == 0 and usage["replayed"]["answers"] == 0
    assert usage["total_tokens"] == api.billed_tokens <= limit
    assert usage["executed"]["answers"] == report["done"] > 2
    assert set(api.executions.values()) == {1}


async def test_a_late_answer_to_the_runs_own_try_is_executed_and_paid(tmp_path: Path) -> None:
    # A try times out, the proxy carries its execution on; a retry under the same key gets the
    # stored answer, `Idempotent-Replayed: true`. This run started that execution: it paid.
    api = LlmApi(delay=0.8)
    items = llm_items(3)
    out = tmp_path / "out.jsonl"
    async with llm_behind_proxy(api, tmp_path / "proxy") as url:
        options = BatchOptions(
            target=url, concurrency=3, timeout=0.4, retries=20, backoff_base=0.2,
            backoff_max=0.3,
        )  # fmt: skip
        summary = await run_batch(items, out, options)
    executed = summary.ledger.to_json(None)  # before: 0 executed, 3 replayed
    assert executed["executed"]["answers"] == 3 and executed["replayed"]["answers"] == 0
    results = read_results(out)
    assert all(r["outcome"] == "done" and r["replayed"] and r["sent_before"] for r in results)
    assert sum(r["usage"]["total_tokens"] for r in results) == api.billed_tokens
    assert summary.replayed == 0 and summary.answered_late == 3
    assert "cost nothing now" not in summary.describe()

    report = await _status(str(out))
    assert report["usage"]["executed"]["total_tokens"] == api.billed_tokens
    assert report["usage"]["replayed"]["answers"] == 0
    assert report["last_run_usage"]["executed"]["answers"] == 3
    assert (report["done"], report["replayed"], report["answered_late"]) == (3, 0, 3)
    code, text = await _cli("status", str(out))
    assert code == 0 and "done     3 (0 replayed, 3 answered late" in text
    assert "tokens   executed 3 answer(s)" in text and "replayed 3" not in text


async def test_a_resume_that_gets_the_answer_counts_it_executed(tmp_path: Path) -> None:
    # The first run gives up on the items (one try, timed out); the proxy finishes them. The
    # resume is answered from those executions: they were this batch's, and paid by it.
    api = LlmApi(delay=0.6)
    items = llm_items(2)
    out = tmp_path / "out.jsonl"
    async with llm_behind_proxy(api, tmp_path / "proxy") as url:
        options = BatchOptions(target=url, timeout=0.2, retries=0)
        first = await run_batch(items, out, options)
        assert first.retryable == 2
        await _until_idle(api)
        second = await run_batch(items, out, replace(options, timeout=30))
    assert second.complete  # before: executed 0 tokens, replayed every one
    assert second.ledger.to_json(None)["executed"]["total_tokens"] == api.billed_tokens
    assert second.answered_late == 2 and second.replayed == 0
    assert second.file_ledger.to_json(None)["in_doubt"]["items"] == 0  # settled by the resume
    report = await _status(str(out))
    assert report["usage"]["executed"]["answers"] == 2 and report["usage"]["in_doubt"]["items"] == 0
    assert report["last_run_usage"]["replayed"]["answers"] == 0


@pytest.mark.parametrize(
    ("script", "outcome", "in_doubt"),
    [
        # The runner's --timeout, then the replay of that try's execution without its body
        # (SPEC §7): it executed and was paid, and nothing says what it used.
        ("slow=1&delay=2&omit=1", "omitted", True),
        # A gateway of the upstream's failed: it may have passed the request on.
        ("fail=9&status=502", "failed", True),
        # The proxy cannot know whether it executed (SPEC §3.2).
        ("fail=9&status=409&code=outcome-unknown", "unknown", True),
        # Refused before anything was sent, then answered: nothing in doubt.
        ("fail=9&status=503", "failed", False),
        # Held past the proxy's max_wait until the retries ran out: an execution of this very
        # key runs (one a killed run of this batch started), and will be paid.
        ("fail=9&status=409&code=request-in-flight", "failed", True),
        ("fail=9&status=503&code=too-many-waiters", "failed", True),
        # Not stored, nothing said of the key's job: it started nothing.
        ("fail=9&status=503&code=store-unavailable", "failed", False),
    ],
)
async def test_what_leaves_an_item_in_doubt(
    api_url: str, tmp_path: Path, script: str, outcome: str, in_doubt: bool
) -> None:
    out = tmp_path / "out.jsonl"
    items = [{"id": "a", "method": "POST", "path": f"/x?{script}", "body": {"max_tokens": 30}}]
    options = BatchOptions(
        target=api_url, timeout=0.5, retries=1, backoff_base=0.001, backoff_max=0.01
    )
    summary = await run_batch(items, out, options)
    [result] = read_results(out)
    assert result["outcome"] == outcome
    assert (result["worst_case"] is not None) is in_doubt
    if in_doubt:
        assert result["worst_case"]["output_tokens"] == 30
        assert len(summary.file_ledger.in_doubt) == 1


async def test_a_resume_that_finds_a_killed_runs_items_running_counts_them(
    tmp_path: Path,
) -> None:
    """A run killed (SIGKILL) with two items executing upstream writes no line for them; the
    proxy goes on executing both (SPEC §2). A resume started at once is held on their keys past
    the proxy's max_wait and answered `409 request-in-flight` until its retries run out: those
    executions will be paid, so their worst case stays counted and the resume stops before the
    budget, sending nothing more. Before, they counted nothing and two more items were paid."""
    api = LlmApi(delay=3.0)
    items = llm_items(6, max_tokens=10)
    limit = _two_fit(items)
    source, out = write_jsonl(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    async with llm_behind_proxy(api, tmp_path / "proxy", {"IDEMPROXY_MAX_WAIT": "0.2"}) as url:
        killed = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "idemproxy", "batch", "run", str(source),
            "--target", url, "--output", str(out), "--concurrency", "2",
            "--max-tokens", str(limit),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(400):
            if api.in_flight == 2:
                break
            await asyncio.sleep(0.025)
        assert api.in_flight == 2
        killed.kill()
        await killed.wait()
        options = BatchOptions(
            target=url, concurrency=2, max_tokens=limit, retries=2,
            backoff_base=0.01, backoff_max=0.05,
        )  # fmt: skip
        summary = await run_batch(items, out, options)
        await _until_idle(api)
    assert len(api.executions) == 2  # the killed run's two; the resume paid for none
    assert summary.budget_stop is not None
    results = read_results(out)
    assert len(results) == 2 and all(r["worst_case"] for r in results)
    assert len(summary.file_ledger.in_doubt) == 2


async def test_the_proxys_unknown_keeps_the_worst_case_and_the_run_stops(tmp_path: Path) -> None:
    # The proxy gives up on the upstream (its --upstream-timeout) and answers `504
    # upstream-timeout`: it cannot know whether the request executed (SPEC §3.2). The item ends
    # `unknown`; before the fix it counted nothing and every item was sent and paid.
    api = LlmApi(delay=1.5)
    items = llm_items(6, max_tokens=10)
    limit = _two_fit(items)
    out = tmp_path / "out.jsonl"
    env = {"IDEMPROXY_UPSTREAM_TIMEOUT": "0.3"}
    async with llm_behind_proxy(api, tmp_path / "proxy", env) as url:
        options = BatchOptions(target=url, concurrency=4, max_tokens=limit)
        summary = await run_batch(items, out, options)
        await _until_idle(api)
    assert summary.budget_stop is not None and summary.interrupted == 4
    assert len(api.executions) == 2 and summary.unknown == 2
    results = read_results(out)
    assert all(r["outcome"] == "unknown" and r["worst_case"] for r in results)
    assert len(summary.file_ledger.in_doubt) == 2
