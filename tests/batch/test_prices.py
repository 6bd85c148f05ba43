"""Pure: the price table (YAML or JSON) and what tokens cost."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from idemproxy.batch.errors import BatchError
from idemproxy.batch.prices import Price, load_prices, money, price_table

YAML = """\
currency: EUR
models:
  gpt-4o-mini: {input: 0.15, output: 0.60}
  gpt-4o: {input: 2.50, output: 10}
"""


def test_yaml_and_json_tables(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(YAML)
    table = load_prices(tmp_path / "p.yaml")
    assert table.currency == "EUR"
    assert table.models["gpt-4o-mini"] == Price(Decimal("0.15"), Decimal("0.60"))
    (tmp_path / "p.json").write_text('{"models": {"m": {"input": 1, "output": "2.5"}}}')
    json_table = load_prices(tmp_path / "p.json")
    assert json_table.currency == "USD" and json_table.models["m"].output == Decimal("2.5")


def test_cost_is_exact_per_million() -> None:
    price = Price(Decimal("0.15"), Decimal("0.60"))
    assert price.of(1_000_000, 0) == Decimal("0.15")
    assert price.of(31, 12) == Decimal("0.00001185")
    # Decimal: the same total whatever the order (floats drift).
    parts = [price.of(n, 2 * n) for n in range(1, 200)]
    assert sum(parts, Decimal(0)) == sum(reversed(parts), Decimal(0))
    assert money(Decimal("0.00001185"), "USD") == "0.000012 USD"
    assert money(Decimal("1.5"), "EUR") == "1.500000 EUR"


def test_dated_model_names_take_the_longest_prefix() -> None:
    table = price_table(
        {
            "models": {
                "gpt-4o": {"input": 2.5, "output": 10},
                "gpt-4o-mini": {"input": 0.15, "output": 0.6},
            }
        }
    )
    assert table.price("gpt-4o-mini-2024-07-18") == table.models["gpt-4o-mini"]
    assert table.price("gpt-4o-2024-08-06") == table.models["gpt-4o"]
    assert table.price("claude-3") is None and table.price(None) is None
    assert table.highest() == Price(Decimal("2.5"), Decimal("10"))


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "expected"),
        ({"models": {"m": {"input": 1}}}, "expected {input"),
        ({"models": {"m": {"input": -1, "output": 1}}}, "≥ 0"),
        ({"models": {"m": {"input": True, "output": 1}}}, "must be a number"),
        ({"models": {"m": {"input": "x", "output": 1}}}, "not a number"),
        ({"models": {"m": {"input": "NaN", "output": 1}}}, "finite"),
        ({"models": {}, "currncy": "USD"}, "unknown key"),
        ({"models": {}, "currency": 3}, "currency"),
    ],
)
def test_bad_tables_are_refused(document: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        price_table(document)


def test_a_bad_file_names_itself(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("models: [\n")
    with pytest.raises(BatchError, match=r"p\.yaml"):
        load_prices(tmp_path / "p.yaml")
    with pytest.raises(BatchError, match="cannot read"):
        load_prices(tmp_path / "missing.yaml")
