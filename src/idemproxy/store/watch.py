"""In-process wake-ups for held duplicates (SPEC §2.3).

A store calls `notify(job_id)` whenever it learns that a job changed: from its own writes
(SQLite) or from `LISTEN/NOTIFY` (PostgreSQL, any replica). Waiters never hold a database
connection while they wait.

The same announcements keep the in-process replay cache honest (store/cache/memory.py): it
registers with `on_change` and serves only while `live`, that is while a change feed from the
source of truth is connected and listening, so that no deletion can pass unseen.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class JobWatch:
    class Subscription:
        def __init__(self) -> None:
            self._event = asyncio.Event()

        def wake(self) -> None:
            self._event.set()

        async def wait(self, timeout: float) -> bool:
            """True when woken, False when `timeout` passed first."""
            try:
                async with asyncio.timeout(timeout):
                    await self._event.wait()
            except TimeoutError:
                return False
            self._event.clear()
            return True

    def __init__(self) -> None:
        self._subscriptions: dict[str, set[JobWatch.Subscription]] = {}
        self._waiting = 0
        # Called with the job id of every announced change, or None for "anything may have
        # changed" (`notify_all`).
        self._listeners: list[Callable[[str | None], None]] = []
        # True while a change feed delivers every change committed by any process (set by the
        # PostgreSQL feed); a store without one (SQLite: other processes' writes) stays False.
        self.live = False
        # The database's clock minus this process's (seconds), measured by the PostgreSQL feed
        # at every heartbeat: the caches reckon a job's remaining life by the database's clock,
        # which decides expiry (SPEC §3.5), whatever this host's clock says.
        self.clock_offset = 0.0

    def on_change(self, listener: Callable[[str | None], None]) -> None:
        self._listeners.append(listener)

    @property
    def waiting(self) -> int:
        """Held duplicates right now, in this process (a gauge; O(1) on the hot path)."""
        return self._waiting

    def waiting_for(self, job_id: str) -> int:
        return len(self._subscriptions.get(job_id, ()))

    @asynccontextmanager
    async def subscribe(self, job_id: str) -> AsyncIterator[JobWatch.Subscription]:
        subscription = JobWatch.Subscription()
        self._subscriptions.setdefault(job_id, set()).add(subscription)
        self._waiting += 1
        try:
            yield subscription
        finally:
            self._waiting -= 1
            subs = self._subscriptions.get(job_id)
            if subs is not None:
                subs.discard(subscription)
                if not subs:
                    del self._subscriptions[job_id]

    def notify(self, job_id: str) -> None:
        for subscription in self._subscriptions.get(job_id, ()):
            subscription.wake()
        for listener in self._listeners:
            listener(job_id)

    def notify_all(self) -> None:
        """Wake everyone to re-read, e.g. after the change feed reconnected."""
        self.wake_all()
        for listener in self._listeners:
            listener(None)

    def wake_all(self) -> None:
        """Wake every held duplicate (a shutdown: proxy/drain.py); nothing changed."""
        for subs in self._subscriptions.values():
            for subscription in subs:
                subscription.wake()
