"""Pure: the usage ledger (each key once, replays apart) and the budget that reads it."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from idemproxy.batch.budget import NOTHING, Budget, Charge, Limits
from idemproxy.batch.input import Item
from idemproxy.batch.ledger import Ledger
from idemproxy.batch.prices import price_table
from idemproxy.batch.records import Outcome, ResultRecord
from idemproxy.batch.usage import WorstCase

from .factory import record

PRICES = price_table(
    {"models": {"cheap": {"input": 1, "output": 2}, "dear": {"input": 10, "output": 20}}}
)


def _used(
    item_id: str, tokens: tuple[int, int], model: str | None = "cheap", **fields: Any
) -> ResultRecord:
    usage = {"input_tokens": tokens[0], "output_tokens": tokens[1], "total_tokens": sum(tokens),
             "model": model}  # fmt: skip
    return record(item_id, usage=usage, **fields)


def test_executed_and_replayed_are_apart_and_each_key_counts_once() -> None:
    ledger = Ledger.of(
        [
            _used("a", (100, 50)),
            _used("b", (10, 5), replayed=True),
            _used("b", (10, 5), replayed=True),  # the same key again: nothing more
            record("c", Outcome.FAILED),  # no usage, and not done: not "unmetered"
            record("d"),  # done without usage
        ]
    )
    report = ledger.to_json(PRICES)
    assert report["executed"] == {"answers": 1, "input_tokens": 100, "output_tokens": 50,
                                  "total_tokens": 150, "cost": 0.0002}  # fmt: skip
    assert report["replayed"]["total_tokens"] == 15 and report["total_tokens"] == 165
    assert report["unmetered"] == 1 and report["unpriced_models"] == []
    assert ledger.to_json(None).keys() == {
        "executed", "replayed", "total_tokens", "unmetered", "unmetered_worst_case", "in_doubt"
    }  # fmt: skip


def test_describe_says_a_replay_costs_nothing_and_names_unpriced_models() -> None:
    ledger = Ledger.of([_used("a", (1000, 0)), _used("b", (7, 3), "mystery", replayed=True)])
    executed, replayed = ledger.describe(PRICES, replay_note="cost nothing now")
    assert executed == "executed 1 answer(s), 1,000 tokens (in 1,000, out 0), 0.001000 USD"
    assert replayed.startswith("replayed 1 answer(s), 10 tokens (in 7, out 3), 0.000000 USD")
    assert "(no price for mystery: not counted)" in replayed and "cost nothing now" in replayed


def test_an_edited_item_sent_again_is_a_second_key_and_counts_again() -> None:
    first = _used("a", (10, 10))
    again = record(Item("a", "POST", "/x", body={"v": 2}), usage=first.usage)
    assert again.key != first.key
    assert Ledger.of([first, again]).total_tokens == 40


def test_the_budget_counts_the_file_and_the_items_in_flight_at_their_worst() -> None:
    ledger = Ledger.of([_used("a", (100, 0))])
    budget = Budget(Limits(max_tokens=300), PRICES, ledger)
    worst = budget.at_worst(WorstCase(50, 50, "cheap"))
    assert worst == Charge(100, Decimal("0.00015"))
    assert budget.fits(worst)
    budget.reserve("b", worst)
    budget.reserve("c", worst)
    assert budget.committed().tokens == 300 and not budget.fits(Charge(1, Decimal(0)))
    assert budget.passed(Charge(301, Decimal(0))) == "--max-tokens 300"
    # "b" ends: its result used less than its worst case, and the room comes back.
    ledger.add(_used("b", (50, 10)))
    budget.settle("b")
    assert budget.committed().tokens == 100 + 60 + 100 and budget.fits(Charge(40, Decimal(0)))


def test_a_cost_budget_prices_unknown_models_at_the_dearest_rates() -> None:
    budget = Budget(Limits(max_cost=Decimal("0.001")), PRICES, Ledger(), assumed_output=10)
    unknown = budget.at_worst(WorstCase(40, None, "typo-model"))
    assert unknown == Charge(50, Decimal("0.0006"))  # 40 x 10 + 10 x 20, per million
    assert budget.fits(unknown)
    budget.reserve("a", unknown)
    assert not budget.fits(unknown)
    assert budget.passed(budget.committed() + unknown) == "--max-cost 0.001"
    assert "the next item, at worst 50 tokens, 0.000600 USD" in budget.describe(unknown)


def test_replays_in_the_file_count_against_the_budget() -> None:
    ledger = Ledger.of([_used("a", (100, 0), replayed=True)])
    assert Budget(Limits(max_tokens=100), PRICES, ledger).spent.tokens == 100


def test_a_line_of_a_file_begun_by_an_older_version_counts_the_usage_its_answer_reports() -> None:
    # Lines written before result lines carried `usage` (and `run`) still hold the answer: a
    # budget on the resumed file counts what those answers were paid, not nothing.
    answer = {"model": "cheap", "usage": {"prompt_tokens": 80, "completion_tokens": 10}}
    older = record("a", body=answer)
    replayed = record("b", body=answer, replayed=True)
    this_version = record("c", body=answer, run="2025-01-01T00:00:00.000Z")
    ledger = Ledger.of([older, replayed, this_version])
    report = ledger.to_json(PRICES)
    assert (report["executed"]["total_tokens"], report["replayed"]["total_tokens"]) == (90, 90)
    assert report["unmetered"] == 1  # a line of this version says itself what it used
    budget = Budget(Limits(max_tokens=200), PRICES, ledger)
    assert budget.spent == Charge(180, Decimal("0.00020"))


def _in_doubt(item_id: str, tokens: tuple[int, int | None], **fields: Any) -> ResultRecord:
    worst = WorstCase(tokens[0], tokens[1], "cheap").to_json()
    return record(item_id, Outcome.FAILED, usage=None, worst_case=worst, retryable=True, **fields)


def test_an_item_sent_without_an_answer_counts_at_its_worst_until_its_key_answers() -> None:
    # SPEC §14: it may have executed and been paid. Before, a line without usage counted 0.
    ledger = Ledger.of([_used("a", (100, 0)), _in_doubt("b", (20, 40))])
    budget = Budget(Limits(max_tokens=200), PRICES, ledger)
    assert budget.spent.tokens == 100 and budget.in_doubt.tokens == 60
    assert budget.committed().tokens == 160 and not budget.fits(Charge(41, Decimal(0)))
    assert budget.counted(record("b").key) and not budget.counted(record("c").key)
    assert "1 item(s) sent and never answered count at worst 60 tokens" in budget.describe(
        Charge(41, Decimal(0))
    )
    report = ledger.to_json(PRICES)["in_doubt"]
    assert (report["items"], report["total_tokens"], report["uncapped"]) == (1, 60, 0)
    # Its replay says what it used: executed (this batch started it), and the doubt is over.
    ledger.add(_used("b", (20, 5), replayed=True))
    assert ledger.in_doubt == {} and budget.committed().tokens == 125
    report = ledger.to_json(None)
    assert report["executed"]["answers"] == 2 and report["replayed"]["answers"] == 0


def test_a_late_answer_counts_executed_in_a_ledger_of_its_run_alone() -> None:
    # `batch status`'s last run: the line that was in doubt belongs to an earlier run.
    late = _used("b", (20, 5), replayed=True, sent_before=True)
    free = _used("c", (20, 5), replayed=True)
    report = Ledger.of([late, free]).to_json(None)
    assert report["executed"]["total_tokens"] == 25 and report["replayed"]["total_tokens"] == 25


def test_the_doubt_ends_with_an_answer_without_usage_and_stays_with_another_doubt() -> None:
    ledger = Ledger.of([_in_doubt("a", (10, 10)), _in_doubt("a", (10, 10))])
    assert len(ledger.in_doubt) == 1  # one key: one execution at most
    ledger.add(record("a", Outcome.FAILED, replayed=True))  # its execution's own answer
    assert ledger.in_doubt == {}
    # Without a cap (no max_tokens, no --assume-max-output) the worst output is not known: the
    # budget counts what --assume-max-output says, the report says how many.
    uncapped = Ledger.of([_in_doubt("b", (10, None))])
    assert uncapped.to_json(None)["in_doubt"]["uncapped"] == 1
    budget = Budget(Limits(max_tokens=100), PRICES, uncapped, assumed_output=50)
    assert budget.in_doubt.tokens == 60


def test_a_line_of_an_older_version_has_no_doubt() -> None:
    older = json.loads(record("a", Outcome.UNKNOWN).to_line())
    del older["worst_case"], older["sent_before"]
    parsed = ResultRecord.from_object(older)
    assert parsed.worst_case is None and not parsed.sent_before
    assert Ledger.of([parsed]).in_doubt == {}


def test_an_answer_without_usage_counts_at_the_worst_case_its_line_keeps() -> None:
    # A stream without usage, a body that is not JSON: executed and paid, amount not said.
    worst = WorstCase(40, 60, "cheap").to_json()
    ledger = Ledger.of([_used("a", (100, 0)), record("b", worst_case=worst), record("c")])
    assert ledger.unmetered == 2 and list(ledger.unmetered_worst) == [record("b").key]
    assert not ledger.in_doubt and ledger.total_tokens == 100 and ledger.metered
    budget = Budget(Limits(max_tokens=250), PRICES, ledger)
    assert budget.committed().tokens == 200 and not budget.fits(Charge(51, Decimal(0)))
    assert "1 answer(s) without usage count at worst 100 tokens" in budget.describe(NOTHING)
    report = ledger.to_json(PRICES)["unmetered_worst_case"]
    assert report == {"items": 1, "input_tokens": 40, "output_tokens": 60,
                      "total_tokens": 100, "cost": 0.00016}  # fmt: skip
    lines = ledger.describe(None, replay_note="")
    assert "usage unknown 1 done answer(s), counted at worst 100 tokens (in 40, out 60)" in lines[1]
    assert lines[2].startswith("1 done answer(s) without usage and no worst case")
    # A later line of the key that says what it used replaces the worst case.
    ledger.add(_used("b", (5, 5)))
    assert not ledger.unmetered_worst and ledger.total_tokens == 110


def test_an_answer_without_usage_to_a_try_in_doubt_moves_it_to_the_worst_case_spent() -> None:
    worst = WorstCase(40, 60, "cheap").to_json()
    late = record("a", worst_case=worst, replayed=True, sent_before=True)
    ledger = Ledger.of([_in_doubt("a", (40, 60)), late])
    assert not ledger.in_doubt and len(ledger.unmetered_worst) == 1
    assert Budget(Limits(max_tokens=100), PRICES, ledger).committed().tokens == 100
