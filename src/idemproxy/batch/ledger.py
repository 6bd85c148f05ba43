"""The usage ledger: tokens (and, with a price table, money) over result lines.

Two columns, because only one of them was paid for now, and the items still in doubt:

* **executed** — answers the upstream gave to this request (`"replayed": false`), and replays
  that answer a try of this batch that was sent and not answered (`"sent_before": true`, or a
  key whose earlier line is in doubt): that execution was this batch's, and paid;
* **replayed** — answers the proxy gave from an execution this batch did not see start. A replay
  costs nothing: its tokens were paid once, when that execution ran (often in a run that was
  killed before it could write the answer), and are shown apart;
* **in doubt** — keys whose last line was sent without an answer (`worst_case`): they may have
  executed and been paid, and count at their worst case against a budget (budget.py) until a
  later line of the same key says what they used;
* **unmetered** — `done` answers that did not say what they used (a stream without usage, a body
  that is not JSON): executed and paid, and counted at the worst case their line keeps
  (`worst_case`). A line without one (nothing capped the answer, or an older version wrote it):
  its tokens are not known.

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
from idemproxy.batch.usage import (
    BUILT_IN_POINTERS,
    Usage,
    WorstCase,
    answer_model,
    extract_usage,
)


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
    # By key: answered without usage (counted at worst), and sent without an answer (in doubt).
    unmetered_worst: dict[str, WorstCase] = field(default_factory=dict)
    in_doubt: dict[str, WorstCase] = field(default_factory=dict)
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
            self._doubt(record)
            return
        if record.key in self._keys:
            return
        self._keys.add(record.key)
        # SPEC §14: the answer to a try of this batch that went unanswered is its execution.
        doubted = self.in_doubt.pop(record.key, None) is not None
        self.unmetered_worst.pop(record.key, None)
        own = record.sent_before or doubted
        (self.replayed if record.replayed and not own else self.executed).add(usage)

    def _doubt(self, record: ResultRecord) -> None:
        """A line without usage: a `done` answer that did not say what it used (at its worst
        case if the line keeps one), or in doubt if it says so; an answer of the execution ends
        the doubt of an earlier line of its key."""
        if record.key in self._keys:
            return  # the key's execution was counted already
        worst = WorstCase.from_json(record.worst_case)
        if worst is not None and record.outcome is not Outcome.DONE:
            self.in_doubt[record.key] = worst
            return
        self.in_doubt.pop(record.key, None)
        if worst is not None:
            self.unmetered_worst[record.key] = worst

    @property
    def total_tokens(self) -> int:
        return self.executed.tokens().total + self.replayed.tokens().total

    @property
    def metered(self) -> bool:
        """Whether there is anything to report: tokens used, or items in doubt."""
        return bool(self.total_tokens or self.in_doubt or self.unmetered_worst)

    def doubt(self) -> Column:
        """The items in doubt at their worst case (an uncapped answer counted as 0 here)."""
        return _at_worst(self.in_doubt.values())

    def unmetered_column(self) -> Column:
        """The answers without usage at their worst case (an uncapped answer counted as 0)."""
        return _at_worst(self.unmetered_worst.values())

    @property
    def uncapped(self) -> int:
        """Items in doubt whose answer nothing capped: their worst case is not known."""
        return sum(worst.output_tokens is None for worst in self.in_doubt.values())

    def to_json(self, prices: PriceTable | None) -> dict[str, Any]:
        executed, replayed = self.executed.tokens(), self.replayed.tokens()
        report: dict[str, Any] = {
            "executed": _tokens_json(executed),
            "replayed": _tokens_json(replayed),
            "total_tokens": executed.total + replayed.total,
            "unmetered": self.unmetered,
            "unmetered_worst_case": self._unmetered_json(),
            "in_doubt": self._doubt_json(),
        }
        if prices is not None:
            executed_cost, unpriced = self.executed.cost(prices)
            replayed_cost, more = self.replayed.cost(prices)
            report["executed"]["cost"] = float(executed_cost)
            report["replayed"]["cost"] = float(replayed_cost)
            report["in_doubt"]["cost"] = float(self.doubt().cost(prices)[0])
            report["unmetered_worst_case"]["cost"] = float(self.unmetered_column().cost(prices)[0])
            report["cost"] = float(executed_cost + replayed_cost)
            report["currency"] = prices.currency
            report["unpriced_models"] = sorted({str(m) for m in unpriced + more})
        return report

    def _doubt_json(self) -> dict[str, Any]:
        tokens = self.doubt().tokens()
        report = _tokens_json(tokens)
        del report["answers"]
        return {"items": tokens.answers, **report, "uncapped": self.uncapped}

    def _unmetered_json(self) -> dict[str, Any]:
        report = _tokens_json(self.unmetered_column().tokens())
        return {"items": report.pop("answers"), **report}

    def describe(self, prices: PriceTable | None, *, replay_note: str) -> list[str]:
        """`executed …` and `replayed …` lines; `replay_note` says what a replay cost."""
        executed, replayed = self.executed.tokens(), self.replayed.tokens()
        lines = [f"executed {_tokens_text(executed)}{self._cost(self.executed, prices)}"]
        if replayed.answers:
            lines.append(
                f"replayed {_tokens_text(replayed)}{self._cost(self.replayed, prices)}"
                f" — {replay_note}"
            )
        if self.in_doubt:
            lines.append(self._describe_doubt(prices))
        if self.unmetered_worst:
            lines.append(self._describe_unmetered(prices))
        unknown = self.unmetered - len(self.unmetered_worst)
        if unknown > 0:
            lines.append(
                f"{unknown} done answer(s) without usage and no worst case (no output cap, or "
                "written by an older version): their tokens are not known"
            )
        return lines

    def _describe_unmetered(self, prices: PriceTable | None) -> str:
        column = self.unmetered_column()
        tokens = column.tokens()
        return (
            f"usage unknown {tokens.answers} done answer(s), counted at worst {tokens.total:,} "
            f"tokens (in {tokens.input:,}, out {tokens.output:,}){self._cost(column, prices)} — "
            "the answer did not say what it used (a stream without usage, a body that is not "
            "JSON)"
        )

    def _describe_doubt(self, prices: PriceTable | None) -> str:
        doubt = self.doubt()
        tokens = doubt.tokens()
        uncapped = f", {self.uncapped} of them uncapped" if self.uncapped else ""
        return (
            f"in doubt {tokens.answers} item(s), at worst {tokens.total:,} tokens "
            f"(in {tokens.input:,}, out {tokens.output:,}){self._cost(doubt, prices)}{uncapped}"
            " — sent, and no answer said what they used: they may have executed and been paid, "
            "and count at their worst case until an answer for their key says"
        )

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


def _at_worst(worst_cases: Iterable[WorstCase]) -> Column:
    column = Column()
    for worst in worst_cases:
        column.add(Usage(worst.input_tokens, worst.output_tokens or 0, worst.model))
    return column


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
