"""The claim of a new job under quotas (SPEC §9) on PostgreSQL: one transaction holding the
owner's advisory lock, so that every replica counts what the others claimed before it.

The claims of one owner take turns in the process first (`OwnerTurns`), without a connection:
only the owner's current claim holds one, and waits on the advisory lock for the other
replicas' claims. A flood of one owner's new keys, admitted or refused, then holds at most one
pooled connection per replica instead of all of them, and other owners keep theirs. While the
owner's turn is taken, a new claim first reads the owner's usage without the lock: one already
over a limit is refused at once, never queued behind the others (`limit_reached`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from idemproxy.core.quota import QuotaLimits, QuotaUsage, exceeded, window_start_id
from idemproxy.errors import StoreUnavailable
from idemproxy.store.postgres.citus import ClaimRow

if TYPE_CHECKING:  # PoolConnectionProxy is generic only in asyncpg-stubs, not at runtime
    import asyncpg
    from asyncpg.pool import PoolConnectionProxy

    Pooled = PoolConnectionProxy[asyncpg.Record]


class _Turn:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0  # claims holding or waiting for the lock: the entry goes with the last


class OwnerTurns:
    """One quota claim per owner at a time in this process, first come first served. A claim
    waits for its turn at most `timeout` (`pool.store_timeout`, as long as it would wait for a
    pooled connection), then the store is unavailable to it (SPEC §11, 503)."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._turns: dict[str, _Turn] = {}

    def busy(self, owner: str) -> bool:
        """Whether a claim of `owner` holds its turn (the next one would wait for it)."""
        turn = self._turns.get(owner)
        return turn is not None and turn.lock.locked()

    def __len__(self) -> int:
        """Owners with a claim taking or waiting for its turn (none left once they are done)."""
        return len(self._turns)

    @contextlib.asynccontextmanager
    async def turn(self, owner: str) -> AsyncIterator[None]:
        turn = self._turns.get(owner)
        if turn is None:
            turn = self._turns[owner] = _Turn()
        turn.users += 1
        try:
            try:
                async with asyncio.timeout(self._timeout):
                    await turn.lock.acquire()
            except TimeoutError as exc:
                raise StoreUnavailable(
                    "The owner's new keys queued for their quota longer than pool.store_timeout."
                ) from exc
            try:
                yield
            finally:
                turn.lock.release()
        finally:
            turn.users -= 1
            if not turn.users:
                del self._turns[owner]


async def claim_row_within(
    conn: Pooled,
    sql: Mapping[str, str],
    owner_key: tuple[str, str],
    limits: QuotaLimits,
    claim: Callable[[Pooled], Awaitable[ClaimRow | None]],
) -> ClaimRow | str | None:
    """`claim`'s row (or None, as `claim` gives: it runs in this transaction, after the count),
    or the name of the limit the new job would exceed (nothing claimed then). A key that exists
    is never refused: it is a duplicate."""
    async with conn.transaction():
        await conn.execute(sql["lock_owner"], owner_key[0])
        limit = await limit_reached(conn, sql, owner_key, limits)
        if limit is not None:
            return limit
        return await claim(conn)


async def limit_reached(
    conn: Pooled, sql: Mapping[str, str], owner_key: tuple[str, str], limits: QuotaLimits
) -> str | None:
    """The limit a new job of the owner would exceed as the store stands (one statement, one
    snapshot), or None; None for a key that exists (a duplicate is never refused).

    Without the owner's lock it may still refuse: at the instant of its snapshot the owner was
    at the limit, and a refusal adds no job for another claim to miss. Only an admission needs
    the lock (`claim_row_within`)."""
    owner, key = owner_key
    usage = await conn.fetchrow(
        sql["quota_usage"], owner, key, window_start_id(), limits.stored_bytes is not None
    )
    assert usage is not None, "quota_usage always returns one row"
    if usage["taken"]:
        return None
    counted = QuotaUsage(
        usage["in_flight"], usage["recent"], usage["stored_bytes"], usage["pending"]
    )
    return exceeded(limits, counted)


class OneAtATime:
    """One holder of a slot per owner at a time; the others wait in the process, holding no
    pooled connection. The owner's entry goes with its last user."""

    def __init__(self) -> None:
        self._slots: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def slot(self, owner: str) -> AsyncIterator[None]:
        lock, users = self._slots.get(owner, (asyncio.Lock(), 0))
        self._slots[owner] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._slots[owner]
            if users == 1:
                del self._slots[owner]
            else:
                self._slots[owner] = (lock, users - 1)
