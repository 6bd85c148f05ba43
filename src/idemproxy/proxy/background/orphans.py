"""Taking over, in the background, the jobs a dead proxy left in flight (SPEC §3.5).

A proxy that dies mid-attempt stops renewing its lease. A request for the same key takes the
job over as `unknown` once the lease ran out, but until one comes the job would stay `in_flight`:
missing from `idemproxy_unknown_jobs` and `jobs list --state unknown`, refused by `jobs
resolve`, never released by `unknown_ttl`. So every proxy looks for such jobs every
`sweeper.takeover_interval` seconds and takes them over with the same compare-and-swap a request
uses (`JobStore.take_over`): of the proxies and requests that try at once exactly one wins.

Only leases that ran out at least one `lease` ago by the database clock are taken: a live proxy
whose renewal is merely late keeps its job unless a request for the key notices first, as before.
A dead proxy's job is therefore `unknown` within `2 * lease + takeover_interval` of its death.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from idemproxy.errors import StoreUnavailable
from idemproxy.store.ports import Housekeeping, JobStore

log = logging.getLogger(__name__)


async def take_over_forever(
    store: Housekeeping,
    jobs: JobStore,
    *,
    interval: float,
    lease: float,
    batch_size: int,
    on_taken: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    """Every `interval` seconds, take over the jobs whose lease ran out `lease` seconds ago."""
    while True:
        await asyncio.sleep(interval)
        try:
            taken = await take_over_orphans(store, jobs, older_than=lease, batch_size=batch_size)
            if taken and on_taken is not None:
                await on_taken(taken)
        except StoreUnavailable:
            log.warning("takeover: store unavailable; will retry in %.1fs", interval)
        except Exception:
            # Like the sweeper: one bad pass must not end the task for good.
            log.exception("takeover: unexpected error; will retry in %.1fs", interval)


async def take_over_orphans(
    store: Housekeeping, jobs: JobStore, *, older_than: float, batch_size: int
) -> int:
    """Take over every job whose lease ran out `older_than` seconds ago, a small batch at a
    time (one short read of `store`, then one CAS per job on the hot path, `jobs`, whose
    layers announce it as a request's takeover is); returns how many this process won."""
    total = 0
    while True:
        orphans = await store.expired_leases(older_than, batch_size)
        won = 0
        for job in orphans:
            if await jobs.take_over(job):
                won += 1
                log.warning(
                    "job %s: its lease ran out (its proxy died, stalled, or could not store the "
                    "outcome: see its store errors); taken over as unknown after %d "
                    "attempt(s), for an operator to resolve",
                    job.id,
                    job.attempt_count,
                )
        total += won
        if len(orphans) < batch_size or won == 0:
            return total
        await asyncio.sleep(0)  # let traffic in between batches
