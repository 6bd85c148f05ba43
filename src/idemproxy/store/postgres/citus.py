"""Distributing the store's tables with Citus (`idemproxy migrate --distribute`, SPEC §11).

Both tables are distributed by `owner` and co-located, so that every hot-path statement, which
names `owner = $1` for each table it touches, runs as a router query on the one shard holding
that owner. Idempotent: tables already distributed that way are left as they are; distributed
any other way, they are an error to resolve by hand, never redistributed behind the operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import asyncpg

from idemproxy.errors import NotDistributable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from asyncpg.pool import PoolConnectionProxy

    Pooled = PoolConnectionProxy[asyncpg.Record]

# A job's row as a claim returns it: read as it is, or inserted (then with `created`).
ClaimRow = asyncpg.Record | dict[str, Any]
_TABLES = ("idemproxy.jobs", "idemproxy.attempts")
_DISTRIBUTION_COLUMN = "owner"


async def citus_version(conn: Pooled, sql: Mapping[str, str]) -> str | None:
    """The Citus extension's version in the connected database; None on a plain PostgreSQL."""
    version = await conn.fetchval(sql["citus_version"])
    return None if version is None else str(version)


def require_citus(version: str | None) -> None:
    """`--distribute` on a database without Citus: an error, before anything is changed."""
    if version is None:
        raise NotDistributable(
            "store: --distribute needs a Citus coordinator, and this database has no citus"
            " extension (CREATE EXTENSION citus, then add the workers: docs/deploy.md)"
        )


async def distribute(conn: Pooled, sql: Mapping[str, str]) -> list[str]:
    """Distribute whichever of the two tables is not yet; the tables it distributed."""
    require_citus(await citus_version(conn, sql))
    known = await _distribution(conn, sql)
    done: list[str] = []
    for table, statement in zip(_TABLES, ("distribute_jobs", "distribute_attempts"), strict=True):
        if table not in known:
            await conn.execute(sql[statement])
            done.append(table)
    _check(await _distribution(conn, sql))
    await _drop_local_copies(conn, sql)
    return done


async def _drop_local_copies(conn: Pooled, sql: Mapping[str, str]) -> None:
    """`create_distributed_table` copies a table's rows into the shards and leaves the originals
    in the coordinator's own relation, never read again: purged owners' keys and response bodies
    would stay on its disk. Emptied once both are distributed, attempts first (their foreign key
    references jobs); only where something is left, so that a rerun takes no table lock."""
    for table in reversed(_TABLES):
        if await conn.fetchval(sql["local_copy_bytes"], table):
            await conn.execute(sql["drop_local_copy"], table)


async def _distribution(conn: Pooled, sql: Mapping[str, str]) -> dict[str, asyncpg.Record]:
    return {row["table_name"]: row for row in await conn.fetch(sql["distributed_tables"])}


def _check(known: Mapping[str, asyncpg.Record]) -> None:
    """Both distributed by owner, in one co-location group; otherwise say what is wrong."""
    for table in _TABLES:
        row = known.get(table)
        if row is None or row["citus_table_type"] != "distributed":
            kind = "missing" if row is None else f"a {row['citus_table_type']} table"
            raise NotDistributable(f"store: {table} is not distributed ({kind})")
        if row["distribution_column"] != _DISTRIBUTION_COLUMN:
            raise NotDistributable(
                f"store: {table} is distributed by {row['distribution_column']!r}, not by"
                f" {_DISTRIBUTION_COLUMN!r}: every statement would span shards (docs/deploy.md)"
            )
    groups = {known[table]["colocation_id"] for table in _TABLES}
    if len(groups) != 1:
        raise NotDistributable(
            "store: idemproxy.jobs and idemproxy.attempts are not co-located: a job and its"
            " attempts must share a shard (docs/deploy.md)"
        )


# --- the Citus forms of the statements that insert an attempt (queries.sql, `…_distributed`) --


async def claim_distributed(
    conn: Pooled, sql: Mapping[str, str], job: tuple[Any, ...], upstream: str
) -> ClaimRow | None:
    """`claim` as router statements: the job read first (a replay costs that one read); else the
    job and its first attempt inserted in one transaction. `job` is `claim`'s $1 to $7 and $9 (the
    lease); None when a concurrent claim won the insert (the caller re-reads)."""
    existing = await conn.fetchrow(sql["get_job"], job[0], job[1])
    if existing is not None:
        return existing
    async with conn.transaction():
        return await insert_claim(conn, sql, job, upstream)


async def read_or_insert_claim(
    conn: Pooled, sql: Mapping[str, str], job: tuple[Any, ...], upstream: str
) -> ClaimRow | None:
    """`claim_distributed` inside the caller's transaction (the quota claim's)."""
    existing = await conn.fetchrow(sql["get_job"], job[0], job[1])
    return existing if existing is not None else await insert_claim(conn, sql, job, upstream)


async def insert_claim(
    conn: Pooled, sql: Mapping[str, str], job: tuple[Any, ...], upstream: str
) -> ClaimRow | None:
    """The job and its first attempt inserted, in the caller's transaction (`claim_distributed`,
    or the quota claim's, store/postgres/quota.py); None when a concurrent claim won."""
    row = await conn.fetchrow(sql["claim_job_distributed"], *job)
    if row is None:
        return None
    await _add_attempt_row(conn, sql, job[0], row, upstream)
    return {**row, "created": True}


async def change_then_add_attempt(
    conn: Pooled,
    sql: Mapping[str, str],
    change: tuple[str, tuple[Any, ...]],
    upstream: str,
    failed: tuple[Any, ...] | None = None,
) -> asyncpg.Record | None:
    """The job's change (a named statement and its arguments), then, when it won, the failed
    attempt ended (`failed`: `finish_attempt`'s arguments) and the next one inserted; one
    transaction on the job's shard."""
    name, args = change
    async with conn.transaction():
        row = await conn.fetchrow(sql[name], *args)
        if row is None:
            return None
        if failed is not None:
            await conn.execute(sql["finish_attempt"], *failed)
        await _add_attempt_row(conn, sql, args[0], row, upstream)
    return row


async def _add_attempt_row(
    conn: Pooled, sql: Mapping[str, str], owner: str, job: asyncpg.Record, upstream: str
) -> None:
    await conn.execute(
        sql["add_attempt_row"],
        owner,
        job["id"],
        job["attempt_count"],
        upstream,
        job["lease_expires_at"],
    )
