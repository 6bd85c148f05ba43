"""Pooled PostgreSQL connections kept between statements and handed straight to waiters.

asyncpg's release shields a new task, arms a timeout and runs the reset hook, and its acquire
goes through its queue and holder, for every statement: about a tenth of the proxy's CPU per
new key (bench/findings.md). A connection whose statement completed is clean (each statement
commits on its own and the session carries no state: `postgres._keep_session`), so it is kept,
last in first out, for the next statement, or handed to the longest-waiting caller when every
connection is in use. Whatever may leave a connection in doubt (an error, a timeout, a
cancellation) is released to the pool instead, which waits out the cancellation, terminates a
broken connection and reconnects; its place goes to the next waiter.

A connection kept idle for longer than `idle_lifetime` (asyncpg's
`max_inactive_connection_lifetime`, 300 s by default) is released to the pool, whose own idle
timer then closes it: after a burst, the connections it needed do not stay open for ever.
asyncpg's recycling of a connection after `max_queries` statements does not apply to kept
connections; a kept connection the server ended is noticed (`is_closed`) and released before
reuse.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

import asyncpg

from idemproxy.errors import StoreUnavailable
from idemproxy.store.postgres.errors import DRIVER_ERRORS

if TYPE_CHECKING:  # PoolConnectionProxy is generic only in asyncpg-stubs, not at runtime
    from asyncpg.pool import PoolConnectionProxy

    Pooled = PoolConnectionProxy[asyncpg.Record]


class KeptConnections:
    """The only way in and out of the pool: `take`, then `keep` or `release` (or `lend`).

    `capacity` is the pool's `max_size`. Once that many connections are out (in use or kept),
    a caller waits in this class's own first-in-first-out queue, bounded by `timeout`, instead
    of in asyncpg's acquire: a finished statement then hands its connection over directly, with
    no round trip through the pool (bench/findings.md, the handoff under load).
    """

    def __init__(
        self, pool: asyncpg.Pool, *, capacity: int, timeout: float, idle_lifetime: float = 300.0
    ) -> None:
        self._pool = pool
        self._capacity = capacity
        self._timeout = timeout
        self._idle_lifetime = idle_lifetime
        self._idle: list[tuple[Pooled, float]] = []  # and since when, oldest first
        self._sweep: asyncio.TimerHandle | None = None
        self._releasing: set[asyncio.Task[None]] = set()
        self._out = 0  # taken from the pool and not given back: in use, kept or being acquired
        self._waiters: collections.deque[asyncio.Future[Pooled | None]] = collections.deque()
        self._closing = False

    async def take(self) -> Pooled:
        deadline: float | None = None
        while True:
            while self._idle:
                conn, _ = self._idle.pop()
                # `_usable`, written out: every statement takes a kept connection.
                try:
                    closed = conn.is_closed()
                except asyncpg.InterfaceError:
                    closed = True
                if not closed:
                    return conn
                await self.release(conn)  # the pool frees its place and reconnects when needed
            if self._closing:
                raise StoreUnavailable("The store is closing.")
            if self._out < self._capacity:
                return await self._from_pool()
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self._timeout
            handed = await self._wait(deadline)
            if handed is not None:
                if _usable(handed):
                    return handed
                await self.release(handed)
            # Otherwise a place came free in the pool (or the connection was dead): go again.

    async def _from_pool(self) -> Pooled:
        self._out += 1
        try:
            return await self._acquire()
        except BaseException:
            self._out -= 1
            self._wake_one(None)
            raise

    def _acquire(self) -> Awaitable[Pooled]:
        """A pooled connection, within the command timeout when it may have to wait.

        asyncpg's `acquire(timeout=…)` arms a deadline for the acquire and then one for the
        release as well, even when an idle connection is there for the taking. So the deadline
        is only armed when the acquire may wait: for a release, or for a new connection.
        """
        if _live_connection_next(self._pool):
            return self._pool.acquire()
        return self._pool.acquire(timeout=self._timeout)

    async def _wait(self, deadline: float) -> Pooled | None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Pooled | None] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_at(deadline, _expire, waiter)
        try:
            return await waiter
        except BaseException:
            # Cancelled (or timed out) in the very instant something was handed over: pass it
            # on, or a connection or a free place would be lost to every later caller.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()
                if handed is None:
                    self._wake_one(None)
                elif not self.keep(handed):
                    await self.release(handed)
            raise
        finally:
            timer.cancel()
            if not waiter.done():
                self._waiters.remove(waiter)

    def _wake_one(self, handed: Pooled | None) -> bool:
        """Hand a connection, or None (a free place), to the longest waiter, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # cancelled or timed out ones are skipped
                waiter.set_result(handed)
                return True
        return False

    @contextlib.asynccontextmanager
    async def lend(self) -> AsyncIterator[Pooled]:
        """A connection for a block of statements, kept after it when the block completed
        (`PostgresStore._run` does the same inline, for its one statement)."""
        conn = await self.take()
        try:
            yield conn
        except BaseException:
            await self.release(conn)
            raise
        if not self.keep(conn):
            await self.release(conn)

    def keep(self, conn: Pooled) -> bool:
        """Keep a connection whose statement completed, or hand it to a waiter; False: release
        it to the pool."""
        if self._closing:
            return False
        if not (self._waiters and self._wake_one(conn)):  # nobody waits: no call to hand it on
            loop = asyncio.get_running_loop()
            self._idle.append((conn, loop.time()))
            if self._sweep is None:
                self._sweep = loop.call_later(self._idle_lifetime, self._release_stale)
        return True

    def _release_stale(self) -> None:
        """Release the connections kept idle for `idle_lifetime` (the oldest are first)."""
        loop = asyncio.get_running_loop()
        self._sweep = None
        cutoff = loop.time() - self._idle_lifetime
        stale = 0
        while stale < len(self._idle) and self._idle[stale][1] <= cutoff:
            stale += 1
        for conn, _ in self._idle[:stale]:
            task = loop.create_task(self._release_quietly(conn))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
        del self._idle[:stale]
        if self._idle:
            self._sweep = loop.call_at(self._idle[0][1] + self._idle_lifetime, self._release_stale)

    async def _release_quietly(self, conn: Pooled) -> None:
        with contextlib.suppress(*DRIVER_ERRORS):
            await self.release(conn)

    async def release(self, conn: Pooled) -> None:
        """Back to the pool, bounded: a statement cut off leaves a cancellation to wait for."""
        try:
            await self._pool.release(conn, timeout=self._timeout)
        finally:
            self._out -= 1
            self._wake_one(None)

    async def close(self) -> None:
        self._closing = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(StoreUnavailable("The store is closing."))
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await self._release_quietly(conn)
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        # The same error as asyncpg's acquire timeout: one of DRIVER_ERRORS (SPEC §11: 503).
        waiter.set_exception(TimeoutError("no pooled connection came free in time"))


def _usable(conn: Pooled) -> bool:
    """Whether a kept connection is still open. One the server ended is handed back to the pool
    by asyncpg itself when it notices, and its proxy then refuses every call."""
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


def _live_connection_next(pool: Any) -> bool:
    """Whether `pool.acquire()` returns at once: its queue's next holder has a live connection.

    asyncpg has no cheap public way to ask (`get_idle_size()` walks every holder, and costs
    twice what it would save), so this reads asyncpg 0.32's internals: `_queue` is a LifoQueue
    of idle holders, its `_queue` their list, and the last one, when live, is the next handed
    out. Should they change, the answer is False and every acquire is bounded, as before
    (tests/store/test_pg_calls.py notices). (A holder of an older generation would
    reconnect, but only `expire_connections()` makes one, and this store never calls it.)
    """
    try:
        return bool(pool._queue._queue[-1].is_connected())
    except (AttributeError, IndexError, TypeError):
        return False
