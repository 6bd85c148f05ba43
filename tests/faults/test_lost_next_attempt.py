"""The issue's defect 6 on a real cut connection: the server commits the statement that starts
the next attempt (`start_next_attempt` after a released first attempt, `fail_over` after a
refused upstream; SPEC §3.4), and the connection between the proxy and PostgreSQL is cut before
its answer arrives (tests/faults/pgcut.py).

The client gets `503 store-unavailable` (nothing was forwarded under that attempt); the proxy
releases the job once the store answers again (proxy/background/unsent.py), so the next retry
runs the request once: never `409 outcome-unknown` for a request that never ran.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp
import pytest

from idemproxy.proxy.background.unsent import NEVER_FORWARDED
from idemproxy.store.queries import load_queries
from tests.support.backend import Ledger
from tests.support.faultproxy import FaultProxy

from .conftest import FaultDatabase, GovernedProxy
from .pgcut import StatementCut
from .test_db_faults import job_of, no_leak
from .traffic import PATH, Answer, send

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

# Long enough that the job is released by the proxy, not taken over after its lease.
LEASE = 10.0
SQL = load_queries("postgres")


async def released_unsent(db: FaultDatabase, key: str) -> list[tuple[str, str | None]]:
    """The attempts of `key`'s job once the proxy released it, the last never forwarded."""

    async def released() -> bool:
        job = await job_of(db, key)
        return job is not None and job[0] == "released" and job[1][-1][1] == NEVER_FORWARDED

    await until_async(released, deadline=LEASE)
    job = await job_of(db, key)
    assert job is not None
    return job[1]


async def until_async(condition: Callable[[], Awaitable[bool]], *, deadline: float) -> None:
    until = time.monotonic() + deadline
    while not await condition():
        if time.monotonic() >= until:
            raise AssertionError("the condition did not come true in time")
        await asyncio.sleep(0.05)


def assert_lost(answer: Answer) -> None:
    assert (answer.status, answer.error) == (503, "store-unavailable"), answer


@pytest.mark.parametrize("kind", ["app", "process"])
async def test_a_cut_after_start_next_attempt_committed(
    kind: str,
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
    cut: StatementCut,
) -> None:
    backend_url, ledger = recording_backend
    upstream = FaultProxy(urlsplit(backend_url).port or 0)
    await upstream.start()
    await upstream.refuse()  # the first attempt: refused, so released (SPEC §3.2)
    try:
        proxy = await governed_proxy(
            kind, store=fault_db.dsn_through(cut), upstream=upstream.url, lease=LEASE
        )
        async with aiohttp.ClientSession() as session:
            refused = await send(session, proxy.url, "next")
            await upstream.start()  # on the same port
            cut.arm(SQL["start_next_attempt"])
            lost = await send(session, proxy.url, "next")
            await cut.cut()
            attempts = await released_unsent(fault_db, "next")
            retry = await send(session, proxy.url, "next")
            replay = await send(session, proxy.url, "next")
    finally:
        await upstream.close()

    assert refused.status == 502, refused
    assert_lost(lost)
    assert cut.cuts == 1
    assert len(attempts) == 2, attempts
    assert (retry.status, retry.replayed) == (201, False), retry
    assert (replay.status, replay.replayed, replay.execution) == (201, True, retry.execution)
    assert ledger.count("next") == 1
    await no_leak(fault_db)


@pytest.mark.parametrize("kind", ["app", "process"])
async def test_a_cut_after_fail_over_committed(
    kind: str,
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
    cut: StatementCut,
) -> None:
    backend_url, ledger = recording_backend
    dead = FaultProxy(urlsplit(backend_url).port or 0)
    await dead.start()
    await dead.refuse()  # the first upstream refuses: nothing executed, the fallback is next
    routes = [{"prefix": PATH, "upstream": dead.url, "fallbacks": [backend_url]}]
    proxy = await governed_proxy(
        kind,
        store=fault_db.dsn_through(cut),
        # A process reads its settings from the environment: a list as JSON.
        routes=routes if kind == "app" else json.dumps(routes),
        lease=LEASE,
    )
    async with aiohttp.ClientSession() as session:
        cut.arm(SQL["fail_over"])
        lost = await send(session, proxy.url, "over")
        await cut.cut()
        attempts = await released_unsent(fault_db, "over")
        retry = await send(session, proxy.url, "over")
        replay = await send(session, proxy.url, "over")

    assert_lost(lost)
    assert cut.cuts == 1
    assert [error for _, error in attempts][1:] == [NEVER_FORWARDED], attempts
    assert (retry.status, retry.replayed) == (201, False), retry
    assert (replay.status, replay.replayed, replay.execution) == (201, True, retry.execution)
    assert ledger.count("over") == 1
    await no_leak(fault_db)
