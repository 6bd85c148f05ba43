"""How long PostgreSQL takes over the statements of one new key, beside the yardstick's two.

The minimal proxy (minimal_proxy.py) spends one `INSERT … ON CONFLICT DO NOTHING` and one
`UPDATE` on a new key; idemproxy spends `claim` and its completion (queries.sql: `complete_sole`
where there is one, else `complete`, as the store sends them). This script runs the four,
prepared (as asyncpg runs them in the proxy), one at a time on one connection, in a throwaway
database of the server the DSN names, interleaved key by key (yardstick INSERT, claim, yardstick
UPDATE, completion), so that both sides see the same server at the same moment. Each is timed
from the client (a round trip on a local socket: the statement's execution and its commit, plus
the protocol, which is the same for all four). Rounds of fresh keys after a warm-up; the median
of each round, and the median of the rounds' medians, in µs.

`--queries LABEL=FILE ...` times the claim and completion of several queries.sql files (e.g.
`git show REV:src/idemproxy/store/sql/postgres/queries.sql`) on the current schema, each key
through every one of them in a different order (the statement right after the yardstick's took
longer, whatever it was). `--batch N` also times `claim_batch` and a batch of completions over N
keys at a time (the group commit's forms: `complete` once per completion in one pipeline, or the
`complete_batch` statement of a queries.sql that has one). `--preload N` first bulk-loads N
completed jobs of the same owner, never analyzed (a loaded store). `--fsync` keeps
`synchronous_commit` on (the proxy's setting): the commit's flush then adds to both sides alike.
`--explain` prints `EXPLAIN (ANALYZE, BUFFERS)` of each statement for one more new key.
docs/benchmarks.md, "What one new key's statements take".

    .venv/bin/python bench/statement_time.py [--rounds 3] [--keys 1500] [--batch 16]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]

from idemproxy.store.postgres.store import PostgresStore  # noqa: E402
from idemproxy.store.queries import load_queries  # noqa: E402

OWNER = "anonymous"
WARM = 300
TTL, LEASE, LATE_BYTES = 86400.0, 30.0, 1 << 20
HEADERS = '[["Content-Type","application/json; charset=utf-8"],["Location","/things/1"]]'
BODY = b'{"id":1,"ok":true}'
YARDSTICK_SCHEMA = """
CREATE SCHEMA minimal;
CREATE TABLE minimal.jobs (
    owner text NOT NULL, key text NOT NULL, state text NOT NULL DEFAULT 'in_flight',
    status integer, headers text, body bytea, UNIQUE (owner, key)
)
"""
YARDSTICK_INSERT = (
    "INSERT INTO minimal.jobs (owner, key) VALUES ($1, $2)"
    " ON CONFLICT (owner, key) DO NOTHING RETURNING true"
)
YARDSTICK_UPDATE = (
    "UPDATE minimal.jobs SET state = 'completed', status = $3, headers = $4, body = $5"
    " WHERE owner = $1 AND key = $2"
)
PRELOAD = """
INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, state, completed_by,
                            response_status, response_headers, response_body, expires_at,
                            sweep_after)
SELECT $1, 'preloaded-' || n, gen_random_uuid(), 'fp', 'POST', '/orders', 'completed', 1, 201,
       $2::jsonb, $3, now() + interval '1 day', now() + interval '1 day'
FROM generate_series(1, $4) AS n
"""
_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
Timed = Callable[[], Awaitable[Any]]


def _queries(path: str | None) -> dict[str, str]:
    if path is None:
        return load_queries("postgres")
    parts = _NAME.split(Path(path).read_text())
    return {
        name: body.strip().rstrip(";") for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


async def _timed(call: Timed) -> tuple[int, Any]:
    start = time.perf_counter_ns()
    result = await call()
    return (time.perf_counter_ns() - start) // 1000, result


class Statements:
    def __init__(self, conn: asyncpg.Connection, sql: dict[str, str]) -> None:
        self.conn, self.sql = conn, sql

    async def prepare(self) -> None:
        self.insert = await self.conn.prepare(YARDSTICK_INSERT)
        self.update = await self.conn.prepare(YARDSTICK_UPDATE)
        self.claim = await self.conn.prepare(self.sql["claim"])
        # What the store sends for a new key: `complete_sole` where there is one.
        self.sole = "complete_sole" in self.sql
        self.complete = await self.conn.prepare(self.sql[self.completion])
        self.claim_batch = await self.conn.prepare(self.sql["claim_batch"])
        # A batch of completions: `complete` once per completion in one pipeline and commit
        # (store/postgres/store.py `_complete_batch`); a queries.sql of before had one statement.
        self.complete_batch = (
            await self.conn.prepare(self.sql["complete_batch"])
            if "complete_batch" in self.sql
            else None
        )

    def claim_args(self, key: str) -> tuple[Any, ...]:
        return (OWNER, key, uuid.uuid4(), "0" * 64, "POST", "/orders", TTL, "http://up/", LEASE)

    @property
    def completion(self) -> str:
        return "complete_sole" if self.sole else "complete"

    def complete_args(self, key: str, job_id: uuid.UUID) -> tuple[Any, ...]:
        terms = (OWNER, job_id, 1, 1, 201, HEADERS, BODY, False, TTL)
        return (*terms, None, key) if self.sole else (*terms, LATE_BYTES, None, key)

    async def yardstick_insert(self, key: str) -> int:
        took, _ = await _timed(lambda: self.insert.fetchval(OWNER, key))
        return took

    async def yardstick_update(self, key: str) -> int:
        took, _ = await _timed(lambda: self.update.fetch(OWNER, key, 201, HEADERS, BODY))
        return took

    async def claim_one(self, key: str) -> tuple[int, uuid.UUID]:
        took, row = await _timed(lambda: self.claim.fetchrow(*self.claim_args(key)))
        assert row is not None and row["created"], "the claim created no job"
        return took, row["id"]

    async def complete_one(self, key: str, job_id: uuid.UUID) -> int:
        args = self.complete_args(key, job_id)
        took, won = await _timed(lambda: self.complete.fetchrow(*args))
        assert won is not None, "the completion lost its compare-and-swap"
        return took

    async def batch(self, keys: list[str]) -> dict[str, int]:
        claims = [self.claim_args(key) for key in keys]
        columns = [list(column) for column in zip(*(args[1:] for args in claims), strict=True)]
        took: dict[str, int] = {}
        took["claim_batch"], rows = await _timed(lambda: self.claim_batch.fetch(OWNER, *columns))
        assert len(rows) == len(keys) and all(row["created"] for row in rows)
        ids = {row["key"]: row["id"] for row in rows}
        n = len(keys)
        completions = (
            [ids[key] for key in keys],
            [1] * n,
            [1] * n,
            [201] * n,
            [HEADERS] * n,
            [BODY] * n,
            [False] * n,
            [TTL] * n,
            [None] * n,
        )
        if self.complete_batch is None:
            runs = [
                (OWNER, job_id, 1, 1, 201, HEADERS, BODY, False, TTL, LATE_BYTES, None, key)
                for job_id, key in sorted(zip(completions[0], keys, strict=True))
            ]
            took["complete_batch"], won = await _timed(
                lambda: self.conn.fetchmany(self.sql["complete"], runs)
            )
        else:
            batched = self.complete_batch
            took["complete_batch"], won = await _timed(
                lambda: batched.fetch(OWNER, *completions, LATE_BYTES, keys)
            )
        assert len(won) == n, "a completion of the batch lost its compare-and-swap"
        return took


def _median(values: list[int]) -> float:
    return float(statistics.median(values))


async def _round(
    variants: dict[str, Statements], prefix: str, keys: int, batch: int
) -> dict[str, float]:
    """`keys` new keys, each through the yardstick and then every variant (a key of its own)."""
    times: dict[str, list[int]] = {}
    yardstick = next(iter(variants.values()))
    labels = list(variants)
    for number in range(keys):
        key = f"{prefix}-{number}"
        # Each key takes the variants in another order: none always runs right after the
        # yardstick's statement (measured: the first after it took ~25 µs more).
        turn = labels[number % len(labels) :] + labels[: number % len(labels)]
        _add(times, "yardstick INSERT", await yardstick.yardstick_insert(key))
        ids = {}
        for label in turn:
            statements = variants[label]
            took, ids[label] = await statements.claim_one(f"{key}{label}")
            _add(times, _named("claim", label), took)
        _add(times, "yardstick UPDATE", await yardstick.yardstick_update(key))
        for label in turn:
            statements = variants[label]
            took = await statements.complete_one(f"{key}{label}", ids[label])
            _add(times, _named("complete", label), took)
    for first in range(0, keys - batch + 1, batch) if batch else ():
        for label, statements in variants.items():
            group = [f"{prefix}-b{n}{label}" for n in range(first, first + batch)]
            for name, value in (await statements.batch(group)).items():
                _add(times, _named(name, label), value)
    return {name: _median(values) for name, values in times.items()}


def _add(times: dict[str, list[int]], name: str, value: int) -> None:
    times.setdefault(name, []).append(value)


def _named(statement: str, label: str) -> str:
    return f"{statement} {label}".rstrip()


async def _explain(conn: asyncpg.Connection, statements: Statements, key: str) -> None:
    await _print_plan(conn, "claim", statements.sql["claim"], statements.claim_args(key))
    job_id = await conn.fetchval(
        "SELECT id FROM idemproxy.jobs WHERE owner = $1 AND key = $2", OWNER, key
    )
    completion = statements.completion
    args = statements.complete_args(key, job_id)
    await _print_plan(conn, completion, statements.sql[completion], args)
    await _print_plan(conn, "yardstick INSERT", YARDSTICK_INSERT, (OWNER, key))
    await _print_plan(conn, "yardstick UPDATE", YARDSTICK_UPDATE, (OWNER, key, 201, HEADERS, BODY))


async def _print_plan(conn: asyncpg.Connection, name: str, sql: str, args: tuple[Any, ...]) -> None:
    rows = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}", *args)
    print(f"--- {name}")
    for row in rows:
        print(row[0])


async def measure(args: argparse.Namespace) -> None:
    admin = await asyncpg.connect(args.dsn)
    database = f"statement_time_{uuid.uuid4().hex[:12]}"
    await admin.execute(f"CREATE DATABASE {database}")
    try:
        await _measure_in(args, _dsn_for(args.dsn, database))
    finally:
        await admin.execute(f"DROP DATABASE {database} WITH (FORCE)")
        await admin.close()


def _dsn_for(dsn: str, database: str) -> str:
    return dsn.rsplit("/", 1)[0] + "/" + database


async def _measure_in(args: argparse.Namespace, dsn: str) -> None:
    store = PostgresStore(dsn)
    await store.open()
    try:
        await store.migrate()
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    await conn.execute(YARDSTICK_SCHEMA)
    await conn.set_type_codec("jsonb", encoder=str, decoder=str, schema="pg_catalog")
    if not args.fsync:
        await conn.execute("SET synchronous_commit = off")
    if args.preload:
        await conn.execute(PRELOAD, OWNER, HEADERS, BODY, args.preload)
    variants = {}
    for label, path in _labelled(args.queries):
        variants[label] = Statements(conn, _queries(path))
        await variants[label].prepare()
    await _round(variants, "warm", WARM, args.batch)
    rounds = [
        await _round(variants, f"r{number}", args.keys, args.batch) for number in range(args.rounds)
    ]
    if args.explain:
        for label, statements in variants.items():
            await _explain(conn, statements, f"explained{label}")
    await conn.close()
    print(
        f"median µs per statement, {args.rounds} rounds x {args.keys} keys"
        f"{', batches of ' + str(args.batch) if args.batch else ''}"
        f"{', ' + str(args.preload) + ' jobs preloaded' if args.preload else ''}"
        f", synchronous_commit {'on' if args.fsync else 'off'}"
    )
    for name in rounds[0]:
        each = [round(r[name]) for r in rounds]
        print(f"{name:26} {_median(each):8.0f}   rounds: {each}")


def _labelled(queries: list[str]) -> list[tuple[str, str | None]]:
    """`--queries LABEL=FILE ...`; none: the installed queries.sql, unlabelled."""
    if not queries:
        return [("", None)]
    return [(q.split("=", 1)[0], q.split("=", 1)[1]) if "=" in q else (q, q) for q in queries]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keys", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--preload", type=int, default=0)
    parser.add_argument("--fsync", action="store_true")
    parser.add_argument("--queries", nargs="*", default=[])
    parser.add_argument("--explain", action="store_true")
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
