"""PostgreSQL down or unreachable (SPEC §11, issue 4.6): fail closed, recover by itself.

On a throwaway PostgreSQL of the test's own (tests/support/pgserver.py), with the proxy both
in-process (`create_app`) and as a real `idemproxy serve` process:

* while the store is down, every governed request gets `503 store-unavailable` with
  `Retry-After`, fast, and nothing reaches the backend; non-governed requests pass through;
* when the store comes back the proxy serves governed requests again without a restart, and
  holds no more connections than its pool plus the change-feed listener;
* stopped and started mid-traffic (concurrent requests on shared keys): no key executes twice, no
  execution without a committed claim, every answer is the upstream's, a replay of it, or an
  allowed problem, and none hangs;
* `on_store_error: passthrough` forwards governed requests untracked while the store is down.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from idemproxy.config.settings import PoolSettings
from idemproxy.constants import JOB_HEADER
from tests.support.backend import Ledger

from .conftest import CONNECTIONS_MAX, LEASE, STORE_TIMEOUT, FaultDatabase, GovernedProxy
from .traffic import (
    PATH,
    Answer,
    after_the_lease,
    assert_one_job_per_intent,
    jobs_by_id,
    keys_of,
    retry_all,
    send,
    settled_connections,
    summary,
    traffic,
    until_executed,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

KINDS = ["app", "process"]
# A fail-closed answer needs at most one pool acquire (a refused connect is immediate).
FAIL_FAST = 3 * STORE_TIMEOUT + 1.0


async def probes(session: aiohttp.ClientSession, admin_url: str) -> tuple[int, int]:
    """(/healthz, /readyz) statuses."""
    async with (
        session.get(admin_url + "/healthz") as health,
        session.get(admin_url + "/readyz") as ready,
    ):
        return health.status, ready.status


async def store_reported(session: aiohttp.ClientSession, admin_url: str) -> object:
    """What /readyz says of the store."""
    async with session.get(admin_url + "/readyz") as ready:
        return (await ready.json())["store"]


def assert_fails_closed(answer: Answer) -> None:
    assert (answer.status, answer.error) == (503, "store-unavailable"), answer
    assert answer.retry_after is not None and int(answer.retry_after) >= 1, answer
    assert answer.content_type == "application/problem+json", answer
    assert answer.seconds < FAIL_FAST, answer


@pytest.mark.parametrize("kind", KINDS)
async def test_store_down_fails_closed_then_recovers(
    kind: str,
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
) -> None:
    ledger = recording_backend[1]
    proxy = await governed_proxy(kind)
    pg = fault_db.server
    async with aiohttp.ClientSession() as session:
        before = await send(session, proxy.url, "before")
        assert (before.status, before.replayed) == (201, False), before

        await asyncio.to_thread(pg.stop, "fast")
        down = [await send(session, proxy.url, f"down-{n}") for n in range(5)]
        # Not even a replay: without the store nothing can be known (fail closed), and the
        # in-process replay cache emptied when its change feed saw the server go.
        down.append(await send(session, proxy.url, "before"))
        for answer in down:
            assert_fails_closed(answer)
        assert ledger.count() == 1, (
            "a governed request reached the backend while the store was down"
        )

        # SPEC §2.5: no key, or a method that is not governed: no storage call, passes through.
        untracked = [
            await send(session, proxy.url, None),
            await send(session, proxy.url, "ignored", method="PUT"),
            await send(session, proxy.url, None, method="GET"),
        ]
        assert [a.status for a in untracked] == [201, 201, 201], untracked
        assert ledger.count() == 4
        if proxy.process is not None:  # the admin listener: alive and ready (SPEC §13)
            # Pass-through traffic flows: the pod must stay in its Service (docs/deploy.md).
            assert await probes(session, proxy.process.admin_url) == (200, 200)
            assert await store_reported(session, proxy.process.admin_url) == "unavailable"

        await asyncio.to_thread(pg.start)
        # The pool saw its sessions end with the server: the first request reconnects.
        healed = await send(session, proxy.url, "after")
        assert (healed.status, healed.replayed) == (201, False), healed
        if proxy.process is not None:
            assert await probes(session, proxy.process.admin_url) == (200, 200)
            assert await store_reported(session, proxy.process.admin_url) == "ok"
        # What failed closed was never claimed: its retry executes now, once.
        retried = await send(session, proxy.url, "down-0")
        replay = await send(session, proxy.url, "before")
        again = await send(session, proxy.url, "down-0")

    assert (retried.status, retried.replayed) == (201, False), retried
    assert (replay.status, replay.replayed, replay.execution) == (201, True, before.execution)
    assert (again.status, again.replayed, again.execution) == (201, True, retried.execution)
    assert ledger.count("down-0") == 1 and ledger.count("down-1") == 0
    connections = await settled_connections(fault_db.proxy_connections, CONNECTIONS_MAX)
    assert connections <= CONNECTIONS_MAX, await fault_db.server.backends(fault_db.name)


@pytest.mark.parametrize("kind", KINDS)
async def test_store_outage_mid_traffic(
    kind: str,
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
) -> None:
    """Stopped for a second under concurrent traffic on shared keys, then started again."""
    ledger = recording_backend[1]
    # The upstream delay keeps attempts in flight when the store goes (claimed, completion
    # pending); max_wait bounds how long a duplicate is held.
    proxy = await governed_proxy(kind, max_wait=3.0)
    pg = fault_db.server
    path = PATH + "?delay=0.05"
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        load = asyncio.create_task(traffic(session, proxy.url, "k", stop, path=path))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(pg.stop, "fast")
        await asyncio.sleep(1.0)
        await asyncio.to_thread(pg.start)
        await asyncio.sleep(1.0)
        stop.set()
        answers = await load
        await asyncio.sleep(LEASE)  # every lease of a job left in flight has run out
        retries = await retry_all(session, proxy.url, sorted(keys_of(answers)), path=path)
        fresh = await until_executed(session, proxy.url, "fresh")

    kinds = summary(answers)
    assert kinds.get("503 store-unavailable"), f"the outage was not seen: {kinds}"
    assert kinds.get("executed") and kinds.get("replayed"), kinds
    await assert_one_job_per_intent(answers + retries, ledger, fault_db.admin_dsn)
    assert not after_the_lease(retries), (summary(retries), after_the_lease(retries)[:10])
    assert (fresh.status, fresh.replayed) == (201, False), fresh
    connections = await settled_connections(fault_db.proxy_connections, CONNECTIONS_MAX)
    assert connections <= CONNECTIONS_MAX, await fault_db.server.backends(fault_db.name)


@pytest.mark.parametrize("kind", KINDS)
async def test_passthrough_opt_out_forwards_untracked(
    kind: str,
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
) -> None:
    """SPEC §11: `on_store_error: passthrough` trades the guarantee for availability."""
    ledger = recording_backend[1]
    proxy = await governed_proxy(kind, on_store_error="passthrough")
    pg = fault_db.server
    async with aiohttp.ClientSession() as session:
        await asyncio.to_thread(pg.stop, "fast")
        first = await send(session, proxy.url, "opt-out")
        second = await send(session, proxy.url, "opt-out")
        await asyncio.to_thread(pg.start)
        healed = await until_executed(session, proxy.url, "after")
        governed = await send(session, proxy.url, "opt-out")

    # Forwarded, and untracked: no job id went upstream or came back, nothing is replayed.
    assert (first.status, first.replayed, first.job) == (201, False, None), first
    assert (second.status, second.replayed, second.job) == (201, False, None), second
    untracked = [e for e in ledger.executions if e.header("Idempotency-Key") == "opt-out"][:2]
    assert [e.header(JOB_HEADER) for e in untracked] == [None, None]
    assert first.execution != second.execution
    # Nothing was recorded: back on the store, the key starts a brand-new job and runs again.
    assert healed.status == 201
    assert (governed.status, governed.replayed) == (201, False), governed
    assert governed.job is not None and governed.job in await jobs_by_id(fault_db.admin_dsn)
    assert ledger.count("opt-out") == 3


async def test_readiness_says_read_only_while_the_server_takes_no_writes(
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
) -> None:
    """A server made read-only under a running proxy (`default_transaction_read_only`, as a
    maintenance window sets it; a hot standby answers the same way): governed requests fail
    closed with nothing forwarded, and /readyz says `read-only` rather than `ok`, so that the
    reader of the probe sees why. Writable again, both recover without a restart."""
    ledger = recording_backend[1]
    proxy = await governed_proxy("process")
    assert proxy.process is not None
    admin = proxy.process.admin_url
    pg = fault_db.server
    async with aiohttp.ClientSession() as session:
        assert await store_reported(session, admin) == "ok"
        await pg.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        try:
            await pg.execute("SELECT pg_reload_conf()")
            # Each session reads the new default once it handles the reload signal.
            for _ in range(100):
                if await store_reported(session, admin) == "read-only":
                    break
                await asyncio.sleep(0.05)
            assert await store_reported(session, admin) == "read-only"
            assert await probes(session, admin) == (200, 200)  # pass-through still flows
            refused = await send(session, proxy.url, "while-read-only")
        finally:
            await pg.execute("ALTER SYSTEM RESET default_transaction_read_only")
            await pg.execute("SELECT pg_reload_conf()")
        assert (refused.status, refused.error) == (503, "store-unavailable"), refused
        assert ledger.count() == 0, "a governed request reached the backend"
        for _ in range(100):
            if await store_reported(session, admin) == "ok":
                break
            await asyncio.sleep(0.05)
        assert await store_reported(session, admin) == "ok"
        healed = await send(session, proxy.url, "while-read-only")
    assert (healed.status, healed.replayed) == (201, False), healed
    assert ledger.count("while-read-only") == 1


async def test_readiness_answers_in_time_while_the_store_is_stalled(
    governed_proxy: GovernedProxy, fault_db: FaultDatabase
) -> None:
    """A frozen server (SIGSTOP: connections open, nothing answers) would hold the store's
    ping for `pool.store_timeout`, past a probe's timeout; /readyz answers within its own
    bound, ready, and says the store is unavailable (docs/deploy.md, Probes)."""
    slow = PoolSettings(store_connections=4, store_timeout=3.0, lease_connections=1)
    proxy = await governed_proxy("process", pool=slow, lease=10.0)
    assert proxy.process is not None
    admin = proxy.process.admin_url
    pg = fault_db.server
    async with aiohttp.ClientSession() as session:
        assert await store_reported(session, admin) == "ok"
        await asyncio.to_thread(pg.pause)
        try:
            began = time.monotonic()
            async with session.get(admin + "/readyz") as ready:
                status, body = ready.status, await ready.json()
            seconds = time.monotonic() - began
        finally:
            await asyncio.to_thread(pg.resume)
    assert (status, body) == (200, {"status": "ready", "store": "unavailable"})
    assert seconds < 1.0, seconds  # a Kubernetes probe's default timeout is 1 s
