"""Keeping an attempt's lease alive while its upstream call runs (SPEC §3.5)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType

from idemproxy.core.types import Job
from idemproxy.errors import StoreUnavailable
from idemproxy.store.ports import JobStore

log = logging.getLogger(__name__)
# A failed renewal is tried again this soon, then twice as late each time (up to lease / 10):
# waiting a third of the lease, as a renewal due on time does, can outlast what is left of it.
_FIRST_RETRY_SECONDS = 0.05
# Below this much time left, a try is bounded only by the store's own timeout: a shorter bound
# could never succeed, and a renewal after the lease ran out still keeps a job that nobody took
# over (the statement is a CAS on the job's version, not on its lease).
_MIN_BOUNDED_TRY_SECONDS = 0.1


class KeptLease:
    """Renew the job's lease every third of its length until the block ends.

    If this process dies, renewals stop and the next request for the key takes the job over
    as `unknown` once the lease ran out by the database clock.

    Almost every attempt ends long before its first renewal is due, so the renewing task is
    only created when that moment comes: until then the block costs one timer.

    A renewal that fails (the store's timeout, a lock, a lost connection) is retried at once,
    each try bounded by the time the lease has left, so that one slow try does not let the lease
    run out under a healthy attempt. The time left is counted from when the statement that set
    the lease was sent (for the first one, from the start of this block), by this process's
    clock; the database's clock only started later, so the lease ends no sooner than that.
    Settings whose `pool.store_timeout` leaves no room for a try are refused at start-up
    (config/settings.py).
    """

    def __init__(self, store: JobStore, job: Job, *, lease: float) -> None:
        self._store = store
        self._job = job
        self._lease = lease
        self._granted = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._renewer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        self._granted = loop.time()
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
            _renew(self._store, self._job, self._lease, self._granted)
        )


async def _renew(store: JobStore, job: Job, lease: float, granted: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        renewed = await _renew_once(store, job, lease, expires=granted + lease)
        if renewed is None:
            return
        granted = renewed
        await asyncio.sleep(max(granted + lease / 3 - loop.time(), 0.0))


async def _renew_once(store: JobStore, job: Job, lease: float, *, expires: float) -> float | None:
    """Try until the store renews the lease: when the successful try was sent, or None when
    the lease is lost (taken over, or the job settled by another attempt)."""
    loop = asyncio.get_running_loop()
    delay = _FIRST_RETRY_SECONDS
    while True:
        sent = loop.time()
        left = expires - sent
        try:
            async with asyncio.timeout(try_bound(left)):
                renewed = await store.renew_lease(job, lease=lease)
        except (StoreUnavailable, TimeoutError):
            log.warning(
                "job %s: lease renewal failed, %.2fs of the lease left; retrying", job.id, left
            )
        else:
            if not renewed:
                log.warning("job %s: lease lost (taken over or settled elsewhere)", job.id)
                return None
            return sent
        await asyncio.sleep(min(delay, lease / 10))
        delay *= 2


def try_bound(left: float) -> float | None:
    """How long one renewal try may take: what is left of the lease, or only the store's own
    timeout once too little is left to bound it usefully."""
    return left if left >= _MIN_BOUNDED_TRY_SECONDS else None
