"""Lease renewals under a slow store (SPEC §3.5), on a throwaway PostgreSQL.

One renewal that takes `pool.store_timeout` to fail must not let a healthy attempt's lease run
out: the renewal is retried at once, within the time the lease has left, on connections that
request traffic cannot take. Shown with the job's row locked by another session for longer than
`pool.store_timeout` (the renewal's UPDATE waits behind it), and with the request pool taken by
other requests whose claims wait on uncommitted inserts of their keys. Settings scaled from the
defaults (lease 10 s, store_timeout 5 s) by a fifth: a lease of 2 s, renewed after 0.67 s; the
row lock (5.6 s scaled, a little longer) outlasts that renewal's timeout. Before the fix the
next try came a third of the lease later, after the lease had ended: a duplicate took the job
over as `unknown`, the upstream's 201 was discarded and every client got 409 outcome-unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import pytest

from idemproxy.config.settings import PoolSettings
from tests.support.backend import Ledger

from .conftest import FaultDatabase, StartApp
from .traffic import PATH, Answer, send

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

LEASE = 2.0
STORE_TIMEOUT = 1.0  # the first renewal, due at 0.67 s, gives up at 1.67 s
UPSTREAM_SECONDS = 2.7  # longer than the lease: alive only if renewed
LOCKED_FROM, LOCKED_UNTIL = 0.45, 1.85  # past the first renewal's timeout, before the lease ends
DUPLICATE_AT = 2.15  # after the lease would have ended, before the old code's next try (2.33)
POOL = 2  # pool.store_connections of the starved proxy
SLOW = f"{PATH}?delay={UPSTREAM_SECONDS}"


def settings(pool_connections: int = 4) -> dict[str, object]:
    # Each claim its own statement (no group commit), so that blocked claims hold every pooled
    # connection: the starvation these tests need (group commit would queue them instead).
    return {
        "lease": LEASE,
        "pool": PoolSettings(
            store_connections=pool_connections, store_timeout=STORE_TIMEOUT, store_batch=1
        ),
        "max_wait": 10.0,
    }


async def at(started: float, moment: float) -> None:
    await asyncio.sleep(max(started + moment - time.monotonic(), 0.0))


async def job_row(db: FaultDatabase, key: str) -> asyncpg.Record:
    conn = await asyncpg.connect(db.admin_dsn)
    try:
        row = await conn.fetchrow(
            "SELECT owner, id, state, version, completed_by FROM idemproxy.jobs WHERE key = $1",
            key,
        )
    finally:
        await conn.close()
    assert row is not None, key
    return row


async def until_claimed(db: FaultDatabase, key: str) -> asyncpg.Record:
    for _ in range(100):
        with contextlib.suppress(AssertionError):
            return await job_row(db, key)
        await asyncio.sleep(0.02)
    raise AssertionError(f"{key} was never claimed")


@contextlib.asynccontextmanager
async def row_locked(db: FaultDatabase, key: str) -> AsyncIterator[None]:
    """`SELECT … FOR UPDATE` of the job's row from another session until the block ends."""
    conn = await asyncpg.connect(db.admin_dsn)
    try:
        async with conn.transaction():
            await conn.execute("SELECT 1 FROM idemproxy.jobs WHERE key = $1 FOR UPDATE", key)
            yield
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def claims_blocked(db: FaultDatabase, owner: str, keys: list[str]) -> AsyncIterator[None]:
    """Uncommitted jobs for `keys`: the proxy's claims of them wait on the unique index (each
    for up to pool.store_timeout, on a pooled connection) until the block ends (rolled back)."""
    conn = await asyncpg.connect(db.admin_dsn)
    try:
        async with conn.transaction():
            for key in keys:
                await conn.execute(
                    "INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path,"
                    " expires_at, lease_expires_at) VALUES ($1, $2, gen_random_uuid(), 'x',"
                    " 'POST', $3, now() + interval '1 hour', now() + interval '1 hour')",
                    owner,
                    key,
                    PATH,
                )
            yield
            raise _RollBack
    except _RollBack:
        pass
    finally:
        await conn.close()


class _RollBack(Exception):
    """Ends `claims_blocked`'s transaction without committing it."""


async def starve(
    session: aiohttp.ClientSession, url: str, keys: list[str], started: float
) -> list[asyncio.Task[Answer]]:
    """Requests for `keys` whose claims wait (each on a pooled connection, or in the queue for
    one) just before the first renewal is due: the first `POOL` take the pool until their
    statements time out, and hand it on to the next ones, queued ahead of the renewal, which
    keep it past the renewal's own deadline."""
    holding = [asyncio.create_task(send(session, url, key)) for key in keys[:POOL]]
    await at(started, LOCKED_FROM + 0.1)
    queued = [asyncio.create_task(send(session, url, key)) for key in keys[POOL:]]
    return holding + queued


def assert_completed_once(first: Answer, duplicate: Answer, ledger: Ledger) -> None:
    assert (first.status, first.error) == (201, None), first
    assert (duplicate.status, duplicate.replayed) == (201, True), duplicate
    assert duplicate.execution == first.execution
    assert ledger.count("healthy") == 1


async def test_a_renewal_behind_a_row_lock_keeps_the_lease(
    proxy_app: StartApp, fault_db: FaultDatabase, recording_backend: tuple[str, Ledger]
) -> None:
    client = await proxy_app(**settings())
    url = str(client.make_url(""))
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(send(session, url, "healthy", path=SLOW))
        await until_claimed(fault_db, "healthy")
        await at(started, LOCKED_FROM)
        async with row_locked(fault_db, "healthy"):
            await at(started, LOCKED_UNTIL)
        await at(started, DUPLICATE_AT)
        duplicate = await send(session, url, "healthy", path=SLOW)
        answered = await first
    assert_completed_once(answered, duplicate, recording_backend[1])
    row = await job_row(fault_db, "healthy")
    assert (row["state"], row["completed_by"]) == ("completed", 1)


async def test_renewals_do_not_wait_for_a_starved_pool(
    proxy_app: StartApp, fault_db: FaultDatabase, recording_backend: tuple[str, Ledger]
) -> None:
    client = await proxy_app(**settings(pool_connections=POOL))
    url = str(client.make_url(""))
    starving = [f"starving-{number}" for number in range(8)]
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(send(session, url, "healthy", path=SLOW))
        owner = (await until_claimed(fault_db, "healthy"))["owner"]
        await at(started, LOCKED_FROM)
        async with claims_blocked(fault_db, owner, starving):
            others = await starve(session, url, starving, started)
            await at(started, LOCKED_UNTIL)
        unavailable = [a for a in await asyncio.gather(*others) if a.status == 503]
        await at(started, DUPLICATE_AT)
        duplicate = await send(session, url, "healthy", path=SLOW)
        answered = await first
    # The pool was taken: claims timed out waiting for it (how many depends on when each one
    # reached the proxy, which a loaded machine spreads out).
    assert unavailable, "no claim waited out pool.store_timeout: the pool was never starved"
    assert_completed_once(answered, duplicate, recording_backend[1])
    row = await job_row(fault_db, "healthy")
    assert (row["state"], row["completed_by"]) == ("completed", 1)
