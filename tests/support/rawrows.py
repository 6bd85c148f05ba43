"""The response columns of a test store's rows, read and written with plain SQL: what a
database dump shows, and what someone with write access to it could change."""

from __future__ import annotations

import sqlite3
import uuid
from typing import Any

import asyncpg

from idemproxy.store.factory import sqlite_path

_PG_JOB = (
    "SELECT response_status, response_headers::text AS response_headers, response_body,"
    " response_key FROM idemproxy.jobs WHERE id = $1"
)
_SQLITE_JOB = (
    "SELECT response_status, response_headers, response_body, response_key FROM jobs WHERE id = ?"
)


class RawRows:
    """Plain SQL on the database at `dsn` (PostgreSQL or SQLite), beside the store's own."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._postgres = dsn.startswith("postgres")

    async def job(self, job_id: str) -> dict[str, Any]:
        if self._postgres:
            row = await self._pg_fetchrow(_PG_JOB, uuid.UUID(job_id))
        else:
            row = self._sqlite_fetchrow(_SQLITE_JOB, job_id)
        assert row is not None, f"no row for job {job_id}"
        return row

    async def set_job(self, job_id: str, column: str, value: object) -> None:
        """Write `value` into one response column of the job's row, as an attacker would."""
        assert column in {"response_body", "response_status", "response_key", "response_headers"}
        if self._postgres:
            sql = f"UPDATE idemproxy.jobs SET {column} = $2 WHERE id = $1"
            await self._pg_execute(sql, uuid.UUID(job_id), value)
        else:
            self._sqlite_execute(f"UPDATE jobs SET {column} = ? WHERE id = ?", value, job_id)

    async def late(self, job_id: str, number: int) -> dict[str, Any]:
        if self._postgres:
            sql = (
                "SELECT late_headers::text AS late_headers, late_body, late_key"
                " FROM idemproxy.attempts WHERE job_id = $1 AND number = $2"
            )
            row = await self._pg_fetchrow(sql, uuid.UUID(job_id), number)
        else:
            sql = (
                "SELECT late_headers, late_body, late_key FROM attempts"
                " WHERE job_id = ? AND number = ?"
            )
            row = self._sqlite_fetchrow(sql, job_id, number)
        assert row is not None
        return row

    async def _pg_fetchrow(self, sql: str, *args: object) -> dict[str, Any] | None:
        conn = await asyncpg.connect(self._dsn)
        try:
            row = await conn.fetchrow(sql, *args)
        finally:
            await conn.close()
        return None if row is None else dict(row)

    async def _pg_execute(self, sql: str, *args: object) -> None:
        conn = await asyncpg.connect(self._dsn)
        try:
            await conn.execute(sql, *args)
        finally:
            await conn.close()

    def _sqlite_fetchrow(self, sql: str, *args: object) -> dict[str, Any] | None:
        with sqlite3.connect(sqlite_path(self._dsn)) as db:
            db.row_factory = sqlite3.Row
            row = db.execute(sql, args).fetchone()
        return None if row is None else dict(row)

    def _sqlite_execute(self, sql: str, *args: object) -> None:
        db = sqlite3.connect(sqlite_path(self._dsn))
        try:
            with db:
                db.execute(sql, args)
        finally:
            db.close()
