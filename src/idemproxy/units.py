"""Durations and sizes as people write them in settings (SPEC §12).

A duration is seconds: a bare number (`30`, `0.5`) or numbers with units, largest first as Go
and Prometheus write them: `250ms`, `30s`, `5m`, `1h`, `1d`, `1h30m`.

A size is bytes: a bare whole number (`1048576`) or a number with a unit. Binary (IEC) units
are powers of 1024: `KiB`, `MiB`, `GiB`, `TiB`, also as Kubernetes writes them (`Ki`, `Mi`, `Gi`,
`Ti`). Decimal (SI) units are powers of 1000: `kB`, `MB`, `GB`, `TB` (`k`, `M`, `G`, `T`), so
`1GB` is 10^9 bytes and `1GiB` 2^30. `B` is bytes. Size units are case-insensitive, duration
units lower case (`m` is minutes, `ms` milliseconds). A size must come to a whole number of
bytes.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import BeforeValidator

_DURATION_UNITS = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION = re.compile(rf"(?:{_DURATION_PART.pattern})+")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}{suffix}": 1024**n for n, p in enumerate("kmgt", 1) for suffix in ("ib", "i")},
    **{f"{p}{suffix}": 1000**n for n, p in enumerate("kmgt", 1) for suffix in ("b", "")},
}
DURATION_HELP = "seconds, or e.g. 250ms, 30s, 5m, 1h"
SIZE_HELP = "bytes, or e.g. 512KiB, 10MiB, 1GB"


def parse_duration(value: Any) -> Any:
    """Seconds (a float) from a duration; anything else is left for the field to refuse."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if _is_number(text):
        return float(text)
    if not _DURATION.fullmatch(text):
        raise ValueError(f"{value!r} is not a duration: give {DURATION_HELP}")
    total = Decimal(0)
    for number, unit in _DURATION_PART.findall(text):
        total += Decimal(number) * _DURATION_UNITS[unit]
    return float(total)


def parse_size(value: Any) -> Any:
    """Bytes (an int) from a size; anything else is left for the field to refuse."""
    if not isinstance(value, str):
        return value
    match = _SIZE.fullmatch(value.strip())
    multiplier = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or multiplier is None:
        raise ValueError(f"{value!r} is not a size: give {SIZE_HELP}")
    size = Decimal(match.group(1)) * multiplier
    if size != size.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(size)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(Decimal(text)))
    except InvalidOperation:
        return False


# Seconds, as a float; the field's own constraints (gt=0, …) apply after the units.
Duration = Annotated[float, BeforeValidator(parse_duration)]
# Bytes, as an int.
ByteSize = Annotated[int, BeforeValidator(parse_size)]
