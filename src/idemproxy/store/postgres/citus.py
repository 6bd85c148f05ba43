"""Distributing the store's tables with Citus (`idemproxy migrate --distribute`, SPEC §11).

Both tables are distributed by `owner` and co-located, so that every hot-path statement, which
names `owner = $1` for each table it touches, runs as a router query on the one shard holding
that owner. Idempotent: tables already distributed that way are left as they are; distributed
any other way, they are an error to resolve by hand, never redistributed behind the operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg

from idemproxy.errors import NotDistributable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from asyncpg.pool import PoolConnectionProxy

    Pooled = PoolConnectionProxy[asyncpg.Record]

_TABLES = ("idemproxy.jobs", "idemproxy.attempts")
_DISTRIBUTION_COLUMN = "owner"


async def citus_version(conn: Pooled, sql: Mapping[str, str]) -> str | None:
    """The Citus extension's version in the connected database; None on a plain PostgreSQL."""
    version = await conn.fetchval(sql["citus_version"])
    return None if version is None else str(version)


async def distribute(conn: Pooled, sql: Mapping[str, str]) -> list[str]:
    """Distribute whichever of the two tables is not yet; the tables it distributed."""
    if await citus_version(conn, sql) is None:
        raise NotDistributable(
            "store: --distribute needs a Citus coordinator, and this database has no citus"
            " extension (CREATE EXTENSION citus, then add the workers: docs/deploy.md)"
        )
    known = await _distribution(conn, sql)
    done: list[str] = []
    for table, statement in zip(_TABLES, ("distribute_jobs", "distribute_attempts"), strict=True):
        if table not in known:
            await conn.execute(sql[statement])
            done.append(table)
    _check(await _distribution(conn, sql))
    return done


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
