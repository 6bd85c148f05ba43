"""The claim of a new job under quotas (SPEC §9) on PostgreSQL: one transaction holding the
owner's advisory lock, so that every replica counts what the others claimed before it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from idemproxy.core.quota import QuotaLimits, QuotaUsage, exceeded, window_start_id
from idemproxy.store.postgres.citus import ClaimRow

if TYPE_CHECKING:
    from idemproxy.store.postgres.kept import Pooled


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
    owner, key = owner_key
    async with conn.transaction():
        await conn.execute(sql["lock_owner"], owner)
        usage = await conn.fetchrow(
            sql["quota_usage"], owner, key, window_start_id(), limits.stored_bytes is not None
        )
        assert usage is not None, "quota_usage always returns one row"
        if not usage["taken"]:
            limit = exceeded(
                limits,
                QuotaUsage(
                    usage["in_flight"], usage["recent"], usage["stored_bytes"], usage["pending"]
                ),
            )
            if limit is not None:
                return limit
        return await claim(conn)
