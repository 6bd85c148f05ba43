"""Keeping an attempt's lease alive while its upstream call runs (SPEC §3.5)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from idemproxy.errors import StoreUnavailable
from idemproxy.store.base import Store
from idemproxy.types import Job

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def lease_kept(store: Store, job: Job, *, lease: float) -> AsyncIterator[None]:
    """Renew the job's lease every third of its length until the block ends.

    If this process dies, renewals stop and the next request for the key takes the job over
    as `unknown` once the lease ran out by the database clock.
    """
    renewer = asyncio.create_task(_renew(store, job, lease))
    try:
        yield
    finally:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer


async def _renew(store: Store, job: Job, lease: float) -> None:
    while True:
        await asyncio.sleep(lease / 3)
        try:
            if not await store.renew_lease(job, lease=lease):
                log.warning("job %s: lease lost (taken over or settled elsewhere)", job.id)
                return
        except StoreUnavailable:
            log.warning("job %s: lease renewal failed; retrying", job.id)
