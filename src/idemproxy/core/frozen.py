"""Frozen to the type checker, plain slots at run time: for the states and events of the pure
machines (core/machine.py, core/attempt_order.py), built several times per request.

A `@dataclass(frozen=True)` sets each field through `object.__setattr__`, about ten times the
cost of a plain slot (bench/findings.md measured it for `Job` and `GovernedRequest`); an
attempt builds seven to ten states and events. Under `frozen`, mypy --strict refuses any
assignment to a field, so nothing assigns to one once built; equality and hashing are by value,
as a frozen dataclass's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True, eq_default=True)
def frozen(cls: type[T]) -> type[T]:
    return dataclass(slots=True, unsafe_hash=True)(cls)
