"""The handoff between store calls when every pooled connection is in use (store/postgres/store.py).

A stand-in pool counts what goes in and out, so the edge cases (a waiter cancelled in the very
instant it was handed a connection, a timed-out waiter, a failed statement's free place) can be
driven step by step; tests/store/test_pg_calls.py runs the same class on a real PostgreSQL.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idemproxy.errors import StoreUnavailable
from idemproxy.store.postgres.store import KeptConnections


class Conn:
    def __init__(self, number: int) -> None:
        self.number = number
        self.closed = False

    def is_closed(self) -> bool:
        return self.closed


class Pool:
    """What KeptConnections uses of asyncpg's pool: acquire and release, counted."""

    def __init__(self) -> None:
        self.made = 0
        self.acquired = 0
        self.released: list[object] = []  # the Conns given back, as KeptConnections sees them

    async def acquire(self, timeout: float | None = None) -> Conn:
        self.acquired += 1
        self.made += 1
        return Conn(self.made)

    async def release(self, conn: Conn, timeout: float | None = None) -> None:
        self.released.append(conn)


def _kept(
    pool: Pool, capacity: int = 1, timeout: float = 2.0, idle_lifetime: float = 300.0
) -> KeptConnections:
    return KeptConnections(
        pool,  # type: ignore[arg-type]
        capacity=capacity,
        timeout=timeout,
        idle_lifetime=idle_lifetime,
    )


async def _waiting(kept: KeptConnections) -> asyncio.Task[Any]:
    task = asyncio.create_task(kept.take())
    await asyncio.sleep(0)  # it found every connection out and queued
    assert not task.done()
    return task


async def test_a_finished_connection_goes_to_the_longest_waiter_without_the_pool() -> None:
    pool = Pool()
    kept = _kept(pool)
    conn = await kept.take()
    first, second = await _waiting(kept), await _waiting(kept)
    assert kept.keep(conn)
    assert await first is conn
    assert not second.done()
    assert kept.keep(conn)
    assert await second is conn
    assert pool.acquired == 1 and pool.released == []  # handed over, never back to the pool


async def test_no_more_than_capacity_connections_are_taken_from_the_pool() -> None:
    pool = Pool()
    kept = _kept(pool, capacity=2)
    a, b = await kept.take(), await kept.take()
    waiter = await _waiting(kept)
    assert pool.acquired == 2
    kept.keep(a)
    assert await waiter is a
    kept.keep(b)
    assert await kept.take() is b  # kept, then taken again: still two in all
    assert pool.acquired == 2


async def test_a_released_connection_frees_a_place_for_a_waiter() -> None:
    pool = Pool()
    kept = _kept(pool)
    conn = await kept.take()
    waiter = await _waiting(kept)
    await kept.release(conn)  # a failed statement: its connection goes back to the pool
    fresh = await waiter
    assert fresh is not conn and pool.acquired == 2 and pool.released == [conn]


async def test_waiting_is_bounded_and_a_timed_out_waiter_takes_nothing() -> None:
    pool = Pool()
    kept = _kept(pool, timeout=0.05)
    conn = await kept.take()
    with pytest.raises(TimeoutError):
        await kept.take()
    kept.keep(conn)
    assert await kept.take() is conn  # kept for the next caller, not handed to the dead waiter


async def test_a_waiter_cancelled_as_it_is_handed_a_connection_passes_it_on() -> None:
    pool = Pool()
    kept = _kept(pool)
    conn = await kept.take()
    cancelled, next_in_line = await _waiting(kept), await _waiting(kept)
    kept.keep(conn)  # handed to the first waiter…
    cancelled.cancel()  # …which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert await next_in_line is conn
    kept.keep(conn)
    assert await kept.take() is conn
    assert pool.acquired == 1 and pool.released == []


async def test_a_waiter_cancelled_as_a_place_came_free_passes_the_place_on() -> None:
    pool = Pool()
    kept = _kept(pool)
    conn = await kept.take()
    cancelled, next_in_line = await _waiting(kept), await _waiting(kept)
    await kept.release(conn)  # wakes the first waiter with a free place
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert isinstance(await next_in_line, Conn)


async def test_a_dead_connection_handed_over_is_released_and_replaced() -> None:
    pool = Pool()
    kept = _kept(pool)
    conn: Any = await kept.take()  # a Conn of the fake pool
    waiter = await _waiting(kept)
    conn.closed = True  # the server ended it after its statement
    kept.keep(conn)
    fresh = await waiter
    assert fresh is not conn and not fresh.closed and pool.released == [conn]


async def test_closing_fails_the_waiters_and_gives_back_the_kept() -> None:
    pool = Pool()
    kept = _kept(pool, capacity=2)
    a, b = await kept.take(), await kept.take()
    kept.keep(a)
    waiter = asyncio.create_task(kept.take())
    await asyncio.sleep(0)
    assert waiter.done() and waiter.result() is a  # an idle one is taken at once
    third = await _waiting(kept)
    await kept.close()
    with pytest.raises(StoreUnavailable):
        await third
    assert not kept.keep(b)  # a statement finishing after close releases its connection
    await kept.release(b)
    with pytest.raises(StoreUnavailable):
        await kept.take()


async def test_connections_kept_idle_past_their_lifetime_go_back_to_the_pool() -> None:
    pool = Pool()
    kept = _kept(pool, capacity=3, idle_lifetime=0.5)
    old, recent = await kept.take(), await kept.take()
    kept.keep(old)
    await asyncio.sleep(0.3)
    kept.keep(recent)
    await asyncio.sleep(0.35)  # old idled 0.65 s, recent 0.35 s (margins for a loaded box)
    assert pool.released == [old]
    assert await kept.take() is recent  # still kept
    kept.keep(recent)
    await asyncio.sleep(0.7)
    assert pool.released == [old, recent]
    fresh = await kept.take()  # from the pool again, within capacity
    assert fresh is not old and fresh is not recent and pool.acquired == 3
    await kept.close()


async def test_a_busy_connection_is_never_released_as_stale() -> None:
    pool = Pool()
    kept = _kept(pool, idle_lifetime=0.5)
    conn = await kept.take()
    for _ in range(12):  # in use every 0.05 s: never idle for its lifetime
        kept.keep(conn)
        await asyncio.sleep(0.05)
        assert await kept.take() is conn
    assert pool.released == []
