"""The usage ledger: tokens (and, with a price table, money) over result lines.

Two columns, because only one of them was paid for now:

* **executed** — answers the upstream gave to this request (`"replayed": false`);
* **replayed** — answers the proxy gave from an earlier execution of the same key. A replay
  costs nothing: its tokens were paid once, when that execution ran (often in a run that was
  killed before it could write the answer), and are shown apart.

Each key is counted once (a key is one execution, SPEC §4): a later line of the same key — a
replay after `--retry-failed`, say — adds nothing. The ledger of a results file counts every
line, not only the last one of each id: an item edited and sent again under `--rerun-changed`
was paid for twice, and both are in the file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from idemproxy.batch.prices import PriceTable, money
from idemproxy.batch.records import Outcome, ResultRecord
from idemproxy.batch.usage import BUILT_IN_POINTERS, Usage, answer_model, extract_usage


@dataclass
class Tokens:
    answers: int = 0
    input: int = 0
    output: int = 0

    @property
    def total(self) -> int:
        return self.input + self.output

    def add(self, usage: Usage) -> None:
        self.answers += 1
        self.input += usage.input_tokens
        self.output += usage.output_tokens


@dataclass
class Column:
    """One column of the ledger, by model (None: neither the request nor the answer named it)."""

    by_model: dict[str | None, Tokens] = field(default_factory=dict)

    def add(self, usage: Usage) -> None:
        self.by_model.setdefault(usage.model, Tokens()).add(usage)

    def tokens(self) -> Tokens:
        total = Tokens()
        for tokens in self.by_model.values():
            total.answers += tokens.answers
            total.input += tokens.input
            total.output += tokens.output
        return total

    def cost(self, prices: PriceTable) -> tuple[Decimal, list[str | None]]:
        """The priced amount and the models the table has no price for (not in the amount)."""
        amount, unpriced = Decimal(0), []
        for model, tokens in self.by_model.items():
            price = prices.price(model)
            if price is None:
                unpriced.append(model)
            else:
                amount += price.of(tokens.input, tokens.output)
        return amount, unpriced


@dataclass
class Ledger:
    executed: Column = field(default_factory=Column)
    replayed: Column = field(default_factory=Column)
    unmetered: int = 0  # done answers that carried no usage
    _keys: set[str] = field(default_factory=set, repr=False)

    @classmethod
    def of(cls, records: Iterable[ResultRecord]) -> Ledger:
        ledger = cls()
        for record in records:
            ledger.add(record)
        return ledger

    def add(self, record: ResultRecord) -> None:
        usage = Usage.from_json(record.usage) or _reported_by_older_line(record)
        if usage is None:
            self.unmetered += record.outcome is Outcome.DONE
            return
        if record.key in self._keys:
            return
        self._keys.add(record.key)
        (self.replayed if record.replayed else self.executed).add(usage)

    @property
    def total_tokens(self) -> int:
        return self.executed.tokens().total + self.replayed.tokens().total

    def to_json(self, prices: PriceTable | None) -> dict[str, Any]:
        executed, replayed = self.executed.tokens(), self.replayed.tokens()
        report: dict[str, Any] = {
            "executed": _tokens_json(executed),
            "replayed": _tokens_json(replayed),
            "total_tokens": executed.total + replayed.total,
            "unmetered": self.unmetered,
        }
        if prices is not None:
            executed_cost, unpriced = self.executed.cost(prices)
            replayed_cost, more = self.replayed.cost(prices)
            report["executed"]["cost"] = float(executed_cost)
            report["replayed"]["cost"] = float(replayed_cost)
            report["cost"] = float(executed_cost + replayed_cost)
            report["currency"] = prices.currency
            report["unpriced_models"] = sorted({str(m) for m in unpriced + more})
        return report

    def describe(self, prices: PriceTable | None, *, replay_note: str) -> list[str]:
        """`executed …` and `replayed …` lines; `replay_note` says what a replay cost."""
        executed, replayed = self.executed.tokens(), self.replayed.tokens()
        lines = [f"executed {_tokens_text(executed)}{self._cost(self.executed, prices)}"]
        if replayed.answers:
            lines.append(
                f"replayed {_tokens_text(replayed)}{self._cost(self.replayed, prices)}"
                f" — {replay_note}"
            )
        if self.unmetered:
            lines.append(
                f"{self.unmetered} done answer(s) without usage: their tokens are not known"
            )
        return lines

    @staticmethod
    def _cost(column: Column, prices: PriceTable | None) -> str:
        if prices is None:
            return ""
        amount, unpriced = column.cost(prices)
        missing = (
            f" (no price for {', '.join(sorted(str(m) for m in unpriced))}: not counted)"
            if unpriced
            else ""
        )
        return f", {money(amount, prices.currency)}{missing}"


def _tokens_json(tokens: Tokens) -> dict[str, Any]:
    return {
        "answers": tokens.answers,
        "input_tokens": tokens.input,
        "output_tokens": tokens.output,
        "total_tokens": tokens.total,
    }


def _tokens_text(tokens: Tokens) -> str:
    return (
        f"{tokens.answers} answer(s), {tokens.total:,} tokens "
        f"(in {tokens.input:,}, out {tokens.output:,})"
    )


def _reported_by_older_line(record: ResultRecord) -> Usage | None:
    """The usage the answer of a line written before lines carried `usage` (nor `run`) reports,
    read with the built-in pointers: a budget on a file begun by an older version counts what its
    answers were paid. A line of this version without `usage` reported none."""
    if record.run is not None or record.outcome is not Outcome.DONE:
        return None
    if record.body_encoding != "json":
        return None
    tokens = extract_usage(record.body, BUILT_IN_POINTERS)
    return None if tokens is None else Usage(*tokens, answer_model(record.body))
