"""Answers that do not say what they used, against a fake paid LLM API behind the real proxy,
driven through the CLI (SPEC §14, docs/batch.md: *Tokens, money and the budget*).

A `200` whose body is not JSON (a plain-text reply) or a stream without a usage event (OpenAI's
`"stream": true` without `stream_options.include_usage`) was executed and billed all the same:
it counts at its worst case, and a budget stops the run before it is passed. A stream that does
carry its usage (OpenAI's last chunk, Anthropic's `message_start` and `message_delta`) counts
what it says.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from idemproxy.batch.input import item_from_object
from idemproxy.batch.usage import worst_case

from .llm import LlmApi, llm_items, usage_of
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


def _worst(item: dict[str, Any]) -> int:
    return int(worst_case(item_from_object(item, 1), None).to_json()["total_tokens"])


def _streamed(items: list[dict[str, Any]], *, include_usage: bool) -> list[dict[str, Any]]:
    """The items as streams; without usage, all OpenAI's (Anthropic's streams always say it)."""
    for item in items:
        item["body"]["stream"] = True
        if include_usage:
            item["body"]["stream_options"] = {"include_usage": True}
        else:
            item["path"], item["body"]["model"] = "/v1/chat/completions", "gpt-4o-mini"
    return items


@pytest.mark.parametrize("answer", ["plain text", "a stream without usage"])
async def test_answers_without_usage_count_at_worst_and_the_run_stops_before_the_budget(
    tmp_path: Path, answer: str
) -> None:
    # The review's run: ten items of max_tokens 100, an API that answers without usage, a
    # budget of 500. Before the fix each answer counted 0 and freed its reservation: all ten
    # were sent and billed, and the run exited 0, "complete".
    api = LlmApi(delay=0.05, plain_text=answer == "plain text")
    items = llm_items(10, max_tokens=100)
    if answer != "plain text":
        items = _streamed(items, include_usage=False)
    worst = [_worst(item) for item in items]
    assert sum(worst[:2]) <= 500 < sum(worst[:3])  # room for the first two at worst
    source, out = write_jsonl(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    async with llm_behind_proxy(api, tmp_path / "proxy") as url:
        status, log = await _cli(
            "run", str(source), "--target", url, "--output", str(out), "--concurrency", "2",
            "--max-tokens", "500",
        )  # fmt: skip
    assert status == 3, log
    assert len(api.executions) == 2 and api.billed_tokens <= 500
    results = read_results(out)
    assert all(r["outcome"] == "done" and r["usage"] is None for r in results)
    counted = sum(r["worst_case"]["total_tokens"] for r in results)
    assert counted == worst[0] + worst[1] >= api.billed_tokens
    assert "budget reached, --max-tokens 500" in log
    assert f"2 answer(s) without usage count at worst {counted:,} tokens" in log
    assert "usage unknown 2 done answer(s), counted at worst" in log

    report = await _status(str(out), "--input", str(source))
    assert report["usage"]["unmetered"] == 2 and report["usage"]["in_doubt"]["items"] == 0
    assert report["usage"]["unmetered_worst_case"]["total_tokens"] == counted
    # A resume counts them too: nothing more fits.
    async with llm_behind_proxy(api, tmp_path / "proxy") as url:
        status, log = await _cli(
            "run", str(source), "--target", url, "--output", str(out), "--max-tokens", "500"
        )  # fmt: skip
    assert status == 3 and len(api.executions) == 2, log


async def test_a_stream_that_says_its_usage_counts_what_it_says(tmp_path: Path) -> None:
    # OpenAI's last chunk (include_usage) and Anthropic's message_start/message_delta: the real
    # usage, so the budget that two worst cases would nearly fill lets all ten through.
    api = LlmApi(delay=0.05)
    items = _streamed(llm_items(10, max_tokens=100), include_usage=True)
    limit = 2 * max(_worst(item) for item in items) + 100
    assert 4 * min(_worst(item) for item in items) > limit  # at worst, four would not fit
    source, out = write_jsonl(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    async with llm_behind_proxy(api, tmp_path / "proxy") as url:
        status, log = await _cli(
            "run", str(source), "--target", url, "--output", str(out), "--concurrency", "2",
            "--max-tokens", str(limit), "--tpm", "100000",
        )  # fmt: skip
    assert status == 0, log
    results = read_results(out)
    assert len(results) == 10 and all(r["worst_case"] is None for r in results)
    # Lines are appended as answers come in: with two at a time, not always in input order.
    by_id = {result["id"]: result for result in results}
    for item in items:
        result = by_id[item["id"]]
        assert result["content_type"].startswith("text/event-stream")
        assert (result["usage"]["input_tokens"], result["usage"]["output_tokens"]) == usage_of(
            item["body"]
        )
    report = await _status(str(out))
    assert report["usage"]["total_tokens"] == api.billed_tokens <= limit
    assert report["usage"]["unmetered"] == 0
