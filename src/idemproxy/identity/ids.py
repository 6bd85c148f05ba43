"""Job ids: UUIDv7 (RFC 9562 §5.7), time-ordered.

A random (v4) id lands on a random leaf of every index over it, so on a large store each new
job read about one uncached index page per id index (bench/findings.md, store growth). A v7 id
starts with the time in milliseconds: new ids land on the right-most leaves, which stay cached.
The 74 bits after the time are random, so ids stay unguessable.
"""

from __future__ import annotations

import time

from idemproxy.randomness import RANDOM_128, refill

_TIME_BITS = (1 << 48) - 1
_RAND_A_BITS = (1 << 12) - 1
_RAND_B_BITS = (1 << 62) - 1


def new_job_id() -> str:
    millis = time.time_ns() // 1_000_000
    try:
        rand = RANDOM_128.pop() >> 48  # 80 bits, as many as the id has room for
    except IndexError:
        rand = refill() >> 48
    value = (
        (millis & _TIME_BITS) << 80
        | 0x7 << 76  # version 7
        | ((rand >> 62) & _RAND_A_BITS) << 64
        | 0b10 << 62  # the RFC 9562 variant
        | (rand & _RAND_B_BITS)
    )
    # The canonical 8-4-4-4-12 text, without building a uuid.UUID (twice as fast).
    digits = f"{value:032x}"
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"
