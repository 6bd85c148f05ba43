"""Housekeeping in small batches without blocking traffic: deleting expired jobs (SPEC §11) and,
when `unknown_ttl` is set, releasing unknown jobs nobody resolved in time (SPEC §3.3)."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from idemproxy.constants import RESOLUTION_UNKNOWN_TTL
from idemproxy.core.types import JobState
from idemproxy.errors import StoreUnavailable
from idemproxy.store.ports import Housekeeping, Operators

log = logging.getLogger(__name__)


class SweptStore(Housekeeping, Operators, Protocol):
    """The sweeper's store: housekeeping's reads and deletes, and the operator's resolution
    with which an unknown job past `unknown_ttl` is released (SPEC §3.3)."""


async def sweep_forever(
    store: SweptStore, *, interval: float, batch_size: int, unknown_ttl: float | None = None
) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await sweep_once(store, batch_size=batch_size)
            if unknown_ttl is not None:
                await release_stale_unknown(store, older_than=unknown_ttl, batch_size=batch_size)
        except StoreUnavailable:
            log.warning("sweeper: store unavailable; will retry in %.0fs", interval)
        except Exception:
            # Housekeeping must outlive any one bad sweep: expiry stops for good otherwise.
            log.exception("sweeper: unexpected error; will retry in %.0fs", interval)


async def sweep_once(store: Housekeeping, *, batch_size: int) -> int:
    """Delete every expired terminal job, one small batch (one short transaction) at a time."""
    total = 0
    while True:
        deleted = await store.sweep_expired(batch_size)
        total += deleted
        if deleted < batch_size:
            return total
        await asyncio.sleep(0)  # let traffic in between batches


async def release_stale_unknown(store: SweptStore, *, older_than: float, batch_size: int) -> int:
    """SPEC §3.3 (opt-in): release unknown jobs unchanged for `older_than` seconds.

    Each release is the same compare-and-swap an operator's is, so replicas sweeping at once,
    or an operator resolving the job meanwhile, release it at most once.
    """
    total = 0
    while True:
        stale = await store.stale_unknown(older_than, batch_size)
        released = 0
        for job in stale:
            if await store.resolve(job, JobState.RELEASED, resolution=RESOLUTION_UNKNOWN_TTL):
                released += 1
                log.warning(
                    "job %s: unknown for over %.0fs after %d attempt(s); released (unknown_ttl)",
                    job.id,
                    older_than,
                    job.attempt_count,
                )
        total += released
        if len(stale) < batch_size or released == 0:
            return total
        await asyncio.sleep(0)  # let traffic in between batches
