"""Random bits for ids (job ids, request ids), from the kernel's CSPRNG (`os.urandom`), read
256 ids at a time: one getrandom system call per id cost each new key two (its job id and its
request id). A process forked from this one starts with none, so that no two processes hand out
the same bits.

The pool is taken from in place, `RANDOM_128.pop()` (atomic: no two threads get the same bits),
and `refill()` called only when it is empty (IndexError): an id costs no call of its own.
"""

from __future__ import annotations

import os

_IDS_PER_READ = 256
# 128-bit values, each handed out once.
RANDOM_128: list[int] = []
os.register_at_fork(after_in_child=RANDOM_128.clear)


def refill() -> int:
    """128 random bits, and the pool filled again for the next ids."""
    fresh = os.urandom(16 * _IDS_PER_READ)
    RANDOM_128.extend(
        int.from_bytes(fresh[at : at + 16], "big") for at in range(16, len(fresh), 16)
    )
    return int.from_bytes(fresh[:16], "big")
