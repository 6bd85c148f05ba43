"""A few PostgreSQL connections of their own for lease renewals (SPEC §3.5).

A renewal that waits for one of the request pool's connections waits behind every request of
the moment: with the pool busy (a burst, or requests stuck behind row locks until
`pool.store_timeout`), a healthy attempt's lease ran out and a duplicate took its job over as
`unknown` while the upstream was still answering. Renewals therefore never touch that pool: they
take one of `pool.lease_connections` connections that nothing else uses. A renewal is one short
statement, so a couple of connections carry those of thousands of attempts in flight (each
renews every lease / 3); a renewal stuck behind a row lock holds one of them, not all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import asyncpg

# Connections unused for this long are closed (asyncpg's default); one is always kept open.
_IDLE_LIFETIME = 300.0


class RenewalConnections:
    """`fetch` on a connection of a small pool reserved for renewals."""

    def __init__(
        self,
        dsn: str,
        *,
        size: int,
        timeout: float,
        init: Callable[[asyncpg.Connection], Coroutine[Any, Any, None]],
    ) -> None:
        self._dsn = dsn
        self._size = size
        self._timeout = timeout
        self._init = init
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        # min_size 1: the first renewal due does not wait for a connection to be made.
        self._pool = await asyncpg.create_pool(
            self._dsn,
            min_size=1,
            max_size=self._size,
            command_timeout=self._timeout,
            max_inactive_connection_lifetime=_IDLE_LIFETIME,
            init=self._init,
        )

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        """Driver errors are the caller's to translate (store/postgres/errors.py)."""
        pool = self._pool
        if pool is None:
            raise asyncpg.InterfaceError("the renewal connections are not open")
        async with pool.acquire(timeout=self._timeout) as conn:
            rows: list[asyncpg.Record] = await conn.fetch(sql, *args)
            return rows

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            await asyncio.wait_for(pool.close(), timeout=self._timeout)
        except TimeoutError:
            pool.terminate()  # renewals are CAS statements: one cut short changes nothing
