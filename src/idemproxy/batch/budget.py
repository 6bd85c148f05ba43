"""Pure: the budget stop (`--max-tokens`, `--max-cost`).

What is counted against a limit is what the results file says was used — every key once, replays
included, since their execution was paid by some run of this file (ledger.py) — plus each item in
flight at its worst case: its prompt at one token per byte (a true upper bound, not the estimate
`--tpm` uses) and the most output its request allows (usage.py). An item is started only if that
sum, with it, stays within every limit; when it would not, and nothing is in flight whose settling
could make room, the run stops starting items. Once an item's result is written its reservation is
replaced by the usage the result records (a failure without usage costs nothing; an answer that
executed and did not say what it used — a stream without usage, a body that is not JSON — keeps its
worst case, counted as spent) — unless it was sent and never answered (a timeout, a connection lost
after sending, `outcome-unknown`): it may have executed and been paid, so the result keeps its worst
case (`worst_case`), and the ledger keeps counting it, in this run and in every resume, until an
answer for its key says what it used (SPEC §14). Sending such an item again reserves nothing more:
behind the proxy its key executes at most once.

A model the price table lacks is counted at the table's dearest rates, so that a typo in a
model name cannot let a batch spend past `--max-cost`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal

from idemproxy.batch.ledger import Column, Ledger
from idemproxy.batch.prices import PriceTable, money
from idemproxy.batch.usage import WorstCase


@dataclass(frozen=True)
class Limits:
    max_tokens: int | None = None
    max_cost: Decimal | None = None

    @property
    def active(self) -> bool:
        return self.max_tokens is not None or self.max_cost is not None


@dataclass(frozen=True)
class Charge:
    tokens: int
    cost: Decimal

    def __add__(self, other: Charge) -> Charge:
        return Charge(self.tokens + other.tokens, self.cost + other.cost)


NOTHING = Charge(0, Decimal(0))


@dataclass
class Budget:
    """The limits, against the results file's ledger (kept up to date as results are written)
    and the reservations of the items in flight."""

    limits: Limits
    prices: PriceTable = field(default_factory=PriceTable)
    ledger: Ledger = field(default_factory=Ledger)
    reserved: dict[str, Charge] = field(default_factory=dict)
    assumed_output: int = 0  # for an item in doubt whose answer nothing capped

    @property
    def spent(self) -> Charge:
        total = NOTHING
        for column in (self.ledger.executed, self.ledger.replayed):
            total += self._column(column)
        return total

    @property
    def in_doubt(self) -> Charge:
        """The items sent and never answered, each at its worst case."""
        return self._at_worst(self.ledger.in_doubt.values())

    @property
    def unmetered(self) -> Charge:
        """The answers that did not say what they used, each at its worst case."""
        return self._at_worst(self.ledger.unmetered_worst.values())

    def counted(self, key: str) -> bool:
        """Whether the key is in doubt: its worst case is counted already."""
        return key in self.ledger.in_doubt

    def charge(self, input_tokens: int, output_tokens: int, model: str | None) -> Charge:
        price = self.prices.price(model) or self.prices.highest()
        return Charge(input_tokens + output_tokens, price.of(input_tokens, output_tokens))

    def at_worst(self, worst: WorstCase) -> Charge:
        """An item's worst case as a charge (`assumed_output` where nothing capped its answer)."""
        output = self.assumed_output if worst.output_tokens is None else worst.output_tokens
        return self.charge(worst.input_tokens, output, worst.model)

    def committed(self) -> Charge:
        # computed once: the ledger is not touched while this runs
        total = self.spent + self.unmetered + self.in_doubt
        for charge in self.reserved.values():
            total += charge
        return total

    def fits(self, charge: Charge) -> bool:
        return self.passed(self.committed() + charge) is None

    def passed(self, total: Charge) -> str | None:
        """The limit `total` would pass, named as its flag, or None."""
        max_tokens, max_cost = self.limits.max_tokens, self.limits.max_cost
        if max_tokens is not None and total.tokens > max_tokens:
            return f"--max-tokens {max_tokens:,}"
        if max_cost is not None and total.cost > max_cost:
            return f"--max-cost {max_cost}"
        return None

    def reserve(self, item_id: str, charge: Charge) -> None:
        self.reserved[item_id] = charge

    def settle(self, item_id: str) -> None:
        """The item ended: its result is in the ledger now (or it was abandoned)."""
        self.reserved.pop(item_id, None)

    def describe(self, charge: Charge) -> str:
        spent = f"spent {self._amount(self.spent)}"
        if self.ledger.unmetered_worst:
            spent += (
                f", and {len(self.ledger.unmetered_worst)} answer(s) without usage count at "
                f"worst {self._amount(self.unmetered)}"
            )
        if self.ledger.in_doubt:
            spent += (
                f", and {len(self.ledger.in_doubt)} item(s) sent and never answered count at "
                f"worst {self._amount(self.in_doubt)}"
            )
        return f"{spent}; the next item, at worst {self._amount(charge)}, would pass"

    def _amount(self, charge: Charge) -> str:
        amount = f"{charge.tokens:,} tokens"
        if self.limits.max_cost is not None:
            amount += f", {money(charge.cost, self.prices.currency)}"
        return amount

    def _at_worst(self, worst_cases: Iterable[WorstCase]) -> Charge:
        total = NOTHING
        for worst in worst_cases:
            total += self.at_worst(worst)
        return total

    def _column(self, column: Column) -> Charge:
        total = NOTHING
        for model, tokens in column.by_model.items():
            total += self.charge(tokens.input, tokens.output, model)
        return total
