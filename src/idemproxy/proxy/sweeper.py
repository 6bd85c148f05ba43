"""Deleting expired jobs in small batches without blocking traffic (SPEC §11)."""

from __future__ import annotations

import asyncio
import logging

from idemproxy.errors import StoreUnavailable
from idemproxy.store.base import Store

log = logging.getLogger(__name__)


async def sweep_forever(store: Store, *, interval: float, batch_size: int) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await sweep_once(store, batch_size=batch_size)
        except StoreUnavailable:
            log.warning("sweeper: store unavailable; will retry in %.0fs", interval)


async def sweep_once(store: Store, *, batch_size: int) -> int:
    """Delete every expired terminal job, one small batch (one short transaction) at a time."""
    total = 0
    while True:
        deleted = await store.sweep_expired(batch_size)
        total += deleted
        if deleted < batch_size:
            return total
        await asyncio.sleep(0)  # let traffic in between batches
