"""The budget stop in a run, against the fake LLM API in-process (no proxy: nothing is resumed)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from idemproxy.batch import BatchOptions, run_batch
from idemproxy.batch.input import item_from_object
from idemproxy.batch.usage import worst_case

from .llm import LlmApi, llm_app, llm_items, per_byte, per_character, usage_of
from .servers import read_results, start_app


@pytest.fixture
async def llm() -> AsyncIterator[tuple[LlmApi, str]]:
    api = LlmApi(delay=0.05)
    runner, url = await start_app(llm_app(api))
    try:
        yield api, url
    finally:
        await runner.cleanup()


async def test_items_in_flight_count_at_their_worst_case(
    llm: tuple[LlmApi, str], tmp_path: Path
) -> None:
    api, url = llm
    items = llm_items(20)
    worst = [
        int(worst_case(item_from_object(item, n), None).to_json()["total_tokens"])
        for n, item in enumerate(items, 1)
    ]
    limit = 2 * max(worst) + 1  # room for any two items at their worst, never for three
    assert 3 * min(worst) > limit
    options = BatchOptions(target=url, concurrency=8, max_tokens=limit)
    summary = await run_batch(items, tmp_path / "out.jsonl", options)

    assert api.most_in_flight == 2  # eight workers, but the budget had room for two at a time
    results = read_results(tmp_path / "out.jsonl")
    used = sum(r["usage"]["total_tokens"] for r in results)
    assert used == api.billed_tokens <= limit
    assert sum(map(sum, (usage_of(i["body"]) for i in items[: len(results)]))) == used
    assert summary.budget_stop is not None and summary.budget_stop.startswith(
        f"--max-tokens {limit:,}: spent {used:,} tokens"
    )
    # More than the two that fit at first: the budget waited for answers to make room.
    assert 2 < summary.done < 20 and summary.interrupted == 20 - summary.done
    assert not summary.stopped and not summary.complete


async def test_answers_without_usage_count_at_their_worst_case_and_the_budget_stops(
    api_url: str, tmp_path: Path
) -> None:
    # JSON answers that say nothing of usage were paid all the same: before, they counted 0 and
    # a budget never stopped them (all six sent, "complete").
    items = [{"id": f"i{n}", "method": "POST", "path": "/x", "body": {"max_tokens": 100}}
             for n in range(6)]  # fmt: skip
    worst = worst_case(item_from_object(items[0], 1), None)
    assert worst.to_json()["total_tokens"] == 118  # {"max_tokens":100}: 18 bytes, and 100
    options = BatchOptions(target=api_url, concurrency=3, max_tokens=300)
    summary = await run_batch(items, tmp_path / "out.jsonl", options)
    assert summary.done == 2 and summary.interrupted == 4 and not summary.complete
    assert summary.budget_stop is not None and "count at worst 236 tokens" in summary.budget_stop
    assert summary.ledger.unmetered == 2 and "usage unknown 2 done answer(s)" in summary.describe()
    results = read_results(tmp_path / "out.jsonl")
    assert [r["worst_case"] for r in results] == [worst.to_json()] * 2


async def test_assume_max_output_gives_uncapped_items_a_worst_case(
    llm: tuple[LlmApi, str], tmp_path: Path
) -> None:
    api, url = llm
    items = llm_items(4)
    for item in items:
        del item["body"]["max_tokens"]
    options = BatchOptions(target=url, max_tokens=10_000, assume_max_output=50)
    summary = await run_batch(items, tmp_path / "out.jsonl", options)
    assert summary.complete and summary.file_ledger.total_tokens == api.billed_tokens > 0


def _cjk_items(count: int) -> list[dict[str, Any]]:
    """Prompts of 900-odd characters, most of them 3 bytes in UTF-8 (and one 4-byte emoji)."""
    items = llm_items(count, max_tokens=20)
    for n, item in enumerate(items):
        item["body"]["messages"][0]["content"] = "漢" * (900 - n) + "字🙂" * (n % 4)
    return items


@pytest.mark.parametrize("tokenizer", [per_character, per_byte])
async def test_cjk_prompts_never_take_the_budget_past_its_limit(
    tokenizer: Callable[[str], int], tmp_path: Path
) -> None:
    # The review's run: 900 漢 a prompt, an API that counts a token per character (910 tokens
    # an item, estimated at 703), eight workers, and the budget was passed: 6,370 for 5,000. The
    # worst case counts the prompt at a token per byte of the body, which no tokenizer exceeds.
    api = LlmApi(delay=0.05, tokenizer=tokenizer, per_message=3)
    runner, url = await start_app(llm_app(api))
    try:
        options = BatchOptions(target=url, concurrency=8, max_tokens=20_000)
        summary = await run_batch(_cjk_items(40), tmp_path / "out.jsonl", options)
    finally:
        await runner.cleanup()
    assert summary.budget_stop is not None and 0 < summary.done < 40
    assert api.most_in_flight > 2  # the workers did run side by side
    assert summary.file_ledger.total_tokens == api.billed_tokens <= 20_000
