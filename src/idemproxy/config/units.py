"""Durations and sizes as people write them in settings (SPEC §12).

A duration is seconds: a bare number (`30`, `0.5`) or numbers with units, largest first as Go
and Prometheus write them: `250ms`, `30s`, `5m`, `1h`, `1d`, `1h30m`.

A size is bytes: a bare whole number (`1048576`) or a number with a unit. Binary (IEC) units
are powers of 1024: `KiB`, `MiB`, `GiB`, `TiB`, also as Kubernetes writes them (`Ki`, `Mi`, `Gi`,
`Ti`). Decimal (SI) units are powers of 1000: `kB`, `MB`, `GB`, `TB` (`k`, `M`, `G`, `T`), so
`1GB` is 10^9 bytes and `1GiB` 2^30. `B` is bytes. Size units are case-insensitive, duration
units lower case (`m` is minutes, `ms` milliseconds). A size must come to a whole number of
bytes.

Digits are ASCII digits; each duration unit appears at most once, largest first (`1h30m`, not
`30m1h` or `1s1s`); `true` is neither a duration nor a size. A duration is at most
`MAX_DURATION_SECONDS` (ten years) and a size at most `MAX_SIZE_BYTES` (1 PiB): beyond them a
deadline overflows a datetime or a timer, and no setting means anything that large.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

_DURATION_UNITS = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
}
_DURATION_ORDER = ("d", "h", "m", "s", "ms")  # largest first, each at most once
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")
_DURATION = re.compile(rf"(?:{_DURATION_PART.pattern})+")
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?) *([a-z]*)", re.IGNORECASE)
MAX_DURATION_SECONDS = 10 * 365 * 86400
MAX_SIZE_BYTES = 2**50
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
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration: give {DURATION_HELP}")
    if not isinstance(value, str):
        return value
    text = value.strip()
    if _is_number(text):
        return float(text)
    if not text.isascii() or not _DURATION.fullmatch(text):
        raise ValueError(f"{value!r} is not a duration: give {DURATION_HELP}")
    parts = _DURATION_PART.findall(text)
    ranks = [_DURATION_ORDER.index(unit) for _, unit in parts]
    if ranks != sorted(set(ranks)):
        raise ValueError(f"{value!r}: give each unit once, largest first (1h30m)")
    total = sum((Decimal(number) * _DURATION_UNITS[unit] for number, unit in parts), Decimal(0))
    return float(total)


def parse_size(value: Any) -> Any:
    """Bytes (an int) from a size; anything else is left for the field to refuse."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size: give {SIZE_HELP}")
    if not isinstance(value, str):
        return value
    text = value.strip()
    match = _SIZE.fullmatch(text) if text.isascii() else None
    multiplier = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or multiplier is None:
        raise ValueError(f"{value!r} is not a size: give {SIZE_HELP}")
    size = Decimal(match.group(1)) * multiplier
    if size != size.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    if size > MAX_SIZE_BYTES:  # before int(): a huge Decimal is a huge integer
        raise ValueError(_too_large())
    return int(size)


def bounded_duration(seconds: float) -> float:
    """A finite duration of at most `MAX_DURATION_SECONDS`."""
    if not math.isfinite(seconds) or seconds > MAX_DURATION_SECONDS:
        raise ValueError(
            f"at most {MAX_DURATION_SECONDS // 86400}d (ten years): a longer one overflows"
            " the deadlines computed from it"
        )
    return seconds


def bounded_size(size: int) -> int:
    """A size of at most `MAX_SIZE_BYTES`."""
    if size > MAX_SIZE_BYTES:
        raise ValueError(_too_large())
    return size


def _too_large() -> str:
    return f"at most {MAX_SIZE_BYTES} bytes (1PiB)"


def _is_number(text: str) -> bool:
    # Decimal() also reads other scripts' digits and `1_000`: ASCII digits only.
    if not text.isascii() or "_" in text:
        return False
    try:
        return math.isfinite(float(Decimal(text)))
    except InvalidOperation:
        return False


# Seconds, as a float; the field's own constraints (gt=0, …) apply after the units.
Duration = Annotated[float, BeforeValidator(parse_duration), AfterValidator(bounded_duration)]
# Bytes, as an int.
ByteSize = Annotated[int, BeforeValidator(parse_size), AfterValidator(bounded_size)]
