"""The claim of a new job under quotas (SPEC §9) on PostgreSQL: one transaction holding the
owner's advisory lock, so that every replica counts what the others claimed before it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import asyncpg

from idemproxy.core.quota import QuotaLimits, QuotaUsage, exceeded, window_start_id

if TYPE_CHECKING:
    from idemproxy.store.postgres.kept import Pooled


async def claim_row_within(
    conn: Pooled,
    sql: Mapping[str, str],
    claim_args: tuple[object, ...],
    limits: QuotaLimits,
) -> asyncpg.Record | str | None:
    """The `claim` row (or None, as `claim` gives), or the name of the limit the new job would
    exceed (nothing claimed then). A key that exists is never refused: it is a duplicate."""
    owner, key = claim_args[0], claim_args[1]
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
        return await conn.fetchrow(sql["claim"], *claim_args)
