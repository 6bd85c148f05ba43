"""Random bits for ids (job ids, request ids), from the kernel's CSPRNG (`os.urandom`), read
256 ids at a time: one getrandom system call per id cost each new key two (its job id and its
request id). A process forked from this one starts with none, so that no two processes hand out
the same bits.
"""

from __future__ import annotations

import os

_IDS_PER_READ = 256
_random: list[int] = []
os.register_at_fork(after_in_child=_random.clear)


def random_128() -> int:
    """128 random bits from `os.urandom` (a CSPRNG), as unguessable as one call per id."""
    try:
        return _random.pop()  # atomic: threads never share bits
    except IndexError:
        fresh = os.urandom(16 * _IDS_PER_READ)
        _random.extend(
            int.from_bytes(fresh[at : at + 16], "big") for at in range(16, len(fresh), 16)
        )
        return int.from_bytes(fresh[:16], "big")
