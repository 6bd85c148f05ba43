"""Quotas per owner (SPEC §9): which limit, if any, a new job of an owner would exceed.

Pure: the store counts (under a per-owner lock, so that replicas on one PostgreSQL enforce one
limit together) and this decides. Only a request that would create a job is counted: a
duplicate or a replay of an existing key adds nothing and is never refused.
"""

from __future__ import annotations

import time
from typing import NamedTuple

# The window of `new_per_second`, in seconds.
RATE_WINDOW_SECONDS = 1.0
# Retry-After of a refusal: a slot in flight or in the rate window frees within about a second;
# stored bytes only as the owner's jobs expire.
IN_FLIGHT_RETRY_AFTER = 1
RATE_RETRY_AFTER = 1
STORED_BYTES_RETRY_AFTER = 60

IN_FLIGHT, RATE, STORED_BYTES = "in_flight", "new_per_second", "stored_bytes"


class QuotaLimits(NamedTuple):
    """The limits per owner; None is no limit. `max_body` is not a limit: the most bytes one
    job in flight may still store (`max_stored_body`), counted against `stored_bytes`."""

    in_flight: int | None = None
    new_per_second: int | None = None
    stored_bytes: int | None = None
    max_body: int = 0

    @property
    def any(self) -> bool:
        return (self.in_flight, self.new_per_second, self.stored_bytes) != (None, None, None)


class QuotaUsage(NamedTuple):
    """What the owner holds now: jobs in flight with a live lease, jobs created in the last
    RATE_WINDOW_SECONDS, bytes of stored response bodies and of late responses kept on
    attempts, and every job in flight, live lease or not (the last two 0 unless the bytes
    limit is set)."""

    in_flight: int
    recent: int
    stored_bytes: int
    pending: int = 0


def committed_bytes(limits: QuotaLimits, usage: QuotaUsage) -> int:
    """SPEC §9: the bytes the owner's jobs hold, or may store once those in flight complete:
    each counts as `max_body`, the most it can store, so concurrent new keys cannot together
    store past the limit (by more than one job's `max_body`)."""
    return usage.stored_bytes + usage.pending * limits.max_body


def exceeded(limits: QuotaLimits, usage: QuotaUsage) -> str | None:
    """The first limit one more job would go beyond, or None."""
    if limits.in_flight is not None and usage.in_flight >= limits.in_flight:
        return IN_FLIGHT
    if limits.new_per_second is not None and usage.recent >= limits.new_per_second:
        return RATE
    if limits.stored_bytes is not None and committed_bytes(limits, usage) >= limits.stored_bytes:
        return STORED_BYTES
    return None


def retry_after(limit: str) -> int:
    return STORED_BYTES_RETRY_AFTER if limit == STORED_BYTES else RATE_RETRY_AFTER


def window_start_id(now: float | None = None) -> str:
    """The lowest job id (UUIDv7, identity/intent.py: milliseconds in the top 48 bits) a job
    created in the rate window can have: the store counts recent jobs on its (owner, id)
    index instead of scanning the owner's jobs."""
    millis = int(((time.time() if now is None else now) - RATE_WINDOW_SECONDS) * 1000)
    digits = f"{max(millis, 0) << 80:032x}"
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"
