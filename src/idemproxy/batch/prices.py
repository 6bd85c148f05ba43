"""The price table: what a million input and output tokens cost, per model (`--prices FILE`).

    # prices.yaml (or the same as JSON)
    currency: USD
    models:
      gpt-4o-mini:       {input: 0.15, output: 0.60}
      claude-3-5-haiku:  {input: 0.80, output: 4.00}

A model is looked up as the request's `model` names it (else as the answer does); a name the
table lacks is matched to the longest table name it starts with, because providers answer with
dated names (`gpt-4o-mini-2024-07-18` is priced as `gpt-4o-mini`). Amounts are decimals, so
totals add up to the cent whatever the order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

import yaml

from idemproxy.batch.errors import BatchError

MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class Price:
    input: Decimal  # per million input tokens
    output: Decimal  # per million output tokens

    def of(self, input_tokens: int, output_tokens: int) -> Decimal:
        return (input_tokens * self.input + output_tokens * self.output) / MILLION


@dataclass(frozen=True)
class PriceTable:
    models: Mapping[str, Price] = field(default_factory=dict)
    currency: str = "USD"

    def price(self, model: str | None) -> Price | None:
        if model is None:
            return None
        exact = self.models.get(model)
        if exact is not None:
            return exact
        prefixes = [name for name in self.models if model.startswith(name)]
        return self.models[max(prefixes, key=len)] if prefixes else None

    def highest(self) -> Price:
        """The dearest rates in the table: what a budget counts a model it cannot price at."""
        if not self.models:
            return Price(Decimal(0), Decimal(0))
        prices = self.models.values()
        return Price(max(p.input for p in prices), max(p.output for p in prices))


def load_prices(path: Path) -> PriceTable:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchError(f"cannot read the price table {path}: {exc}") from exc
    try:
        document = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
        return price_table(document)
    except (ValueError, yaml.YAMLError) as exc:
        raise BatchError(f"price table {path}: {exc}") from exc


def price_table(document: object) -> PriceTable:
    """Validated: `models` maps names to non-negative `input` and `output` prices."""
    if not isinstance(document, Mapping) or not isinstance(document.get("models"), Mapping):
        raise ValueError('expected "models": {name: {input: …, output: …}} (and "currency")')
    unknown = set(document) - {"models", "currency"}
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(map(str, unknown)))}")
    currency = document.get("currency", "USD")
    if not isinstance(currency, str) or not currency:
        raise ValueError('"currency" must be a name such as USD')
    models = {str(name): _price(str(name), rates) for name, rates in document["models"].items()}
    return PriceTable(models, currency)


def _price(name: str, rates: object) -> Price:
    if not isinstance(rates, Mapping) or set(rates) != {"input", "output"}:
        raise ValueError(f"model {name!r}: expected {{input: …, output: …}} per million tokens")
    return Price(_amount(name, rates["input"]), _amount(name, rates["output"]))


def _amount(name: str, value: object) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"model {name!r}: a price must be a number, not {value!r}")
    try:
        amount = Decimal(str(value))  # str: 0.15 stays 0.15, not its binary approximation
    except InvalidOperation as exc:
        raise ValueError(f"model {name!r}: {value!r} is not a number") from exc
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"model {name!r}: a price must be a finite number ≥ 0")
    return amount


def money(amount: Decimal, currency: str) -> str:
    """An amount to the millionth: one item of a cheap model costs a few of them."""
    return f"{amount.quantize(Decimal('0.000001'))} {currency}"
