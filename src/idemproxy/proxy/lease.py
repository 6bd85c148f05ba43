"""Keeping an attempt's lease alive while its upstream call runs (SPEC §3.5)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType

from idemproxy.errors import StoreUnavailable
from idemproxy.store.base import Store
from idemproxy.types import Job

log = logging.getLogger(__name__)


class KeptLease:
    """Renew the job's lease every third of its length until the block ends.

    If this process dies, renewals stop and the next request for the key takes the job over
    as `unknown` once the lease ran out by the database clock.

    Almost every attempt ends long before its first renewal is due, so the renewing task is
    only created when that moment comes: until then the block costs one timer.
    """

    def __init__(self, store: Store, job: Job, *, lease: float) -> None:
        self._store = store
        self._job = job
        self._lease = lease
        self._timer: asyncio.TimerHandle | None = None
        self._renewer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._lease / 3, self._start_renewing)

    async def __aexit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        renewer = self._renewer
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer

    def _start_renewing(self) -> None:
        self._renewer = asyncio.get_running_loop().create_task(
            _renew(self._store, self._job, self._lease)
        )


async def _renew(store: Store, job: Job, lease: float) -> None:
    while True:
        try:
            if not await store.renew_lease(job, lease=lease):
                log.warning("job %s: lease lost (taken over or settled elsewhere)", job.id)
                return
        except StoreUnavailable:
            log.warning("job %s: lease renewal failed; retrying", job.id)
        await asyncio.sleep(lease / 3)
