"""Database faults (issue 8.2): sessions killed at each step, restarts and stalls under traffic.

All on a throwaway PostgreSQL (tests/support/pgserver.py). The proxy's connections carry an
`application_name` (set in the DSN), so the test finds exactly the backend that runs a given
statement: it holds `LOCK TABLE idemproxy.jobs` from a connection of its own, waits until the
proxy's statement queues behind the lock, and `pg_terminate_backend`s that session.

What SPEC §2.2, §3.2 and §3.5 require, and these tests show:

* killed at the claim: the claim rolled back, the client gets `503 store-unavailable`, nothing
  went upstream; a retry executes it once;
* killed between claim and completion (idle pooled sessions): the completion takes a new
  connection, the client gets the upstream's answer;
* killed during the completion: the upstream executed once, the client gets 503, and the proxy
  writes the outcome once the store answers: a retry gets the replay, never a second execution;
* fast and immediate restarts and a crash (SIGKILL) under traffic, a table lock and a frozen
  server (SIGSTOP) longer than `pool.store_timeout`: bounded answers, never a hang, never an
  execution without a committed claim, never two executions of one key, no leaked connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import asyncpg
import pytest

from idemproxy.constants import WAITER_RECHECK_SECONDS
from idemproxy.proxy.background.unsent import NEVER_FORWARDED
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.postgres import listen as pg_listen
from tests.support.backend import Ledger

from .blackhole import Relay
from .conftest import (
    APPLICATION_NAME,
    CONNECTIONS_MAX,
    LEASE,
    STORE_TIMEOUT,
    FaultDatabase,
    GovernedProxy,
    StartApp,
)
from .traffic import (
    PATH,
    after_the_lease,
    assert_one_job_per_intent,
    keys_of,
    retry_all,
    send,
    settled_connections,
    summary,
    traffic,
    until_executed,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

CLAIM_SQL = "ON CONFLICT (owner, key) DO NOTHING"  # a fragment of each named statement
COMPLETE_SQL = "completed_by = $4"
# A store call gives up after pool.store_timeout (acquire, statement, release of a cancelled
# one); a request makes a few store calls, one upstream call (delay), and answers.
ANSWER_LIMIT = 6 * STORE_TIMEOUT + 1.0
# A held retry re-reads its job every WAITER_RECHECK_SECONDS: it sees the lease run out by then.
TAKEOVER_LIMIT = LEASE + WAITER_RECHECK_SECONDS + 2.0


@contextlib.asynccontextmanager
async def jobs_locked(db: FaultDatabase) -> AsyncIterator[None]:
    """Hold `LOCK TABLE idemproxy.jobs IN ACCESS EXCLUSIVE MODE` until the block ends: every
    statement of the proxy's queues behind it (a stalled store)."""
    conn = await asyncpg.connect(db.admin_dsn)
    try:
        async with conn.transaction():
            await conn.execute("LOCK TABLE idemproxy.jobs IN ACCESS EXCLUSIVE MODE")
            yield
    finally:
        await conn.close()


async def blocked_backend(db: FaultDatabase, fragment: str, *, deadline: float = 15.0) -> int:
    """The pid of the proxy's session whose statement (containing `fragment`) waits on a lock
    (within `deadline`: on a loaded machine the request may take seconds to reach it)."""
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        for row in await db.server.backends(db.name):
            if (
                row["application_name"] == APPLICATION_NAME
                and row["wait_event_type"] == "Lock"
                and fragment in row["query"]
            ):
                pid: int = row["pid"]
                return pid
        await asyncio.sleep(0.01)
    raise AssertionError(f"no proxy statement with {fragment!r} waited on the lock")


async def job_of(db: FaultDatabase, key: str) -> tuple[str, list[tuple[str, str | None]]] | None:
    """(job state, [(attempt state, attempt error)]) for `key`, or None without a job."""
    conn = await asyncpg.connect(db.admin_dsn)
    try:
        job = await conn.fetchrow("SELECT owner, id, state FROM idemproxy.jobs WHERE key = $1", key)
        if job is None:
            return None
        attempts = await conn.fetch(
            "SELECT state, error FROM idemproxy.attempts WHERE owner = $1 AND job_id = $2"
            " ORDER BY number",
            job["owner"],
            job["id"],
        )
    finally:
        await conn.close()
    return job["state"], [(a["state"], a["error"]) for a in attempts]


async def until_claimed(db: FaultDatabase, key: str, *, deadline: float = 5.0) -> None:
    until = time.monotonic() + deadline
    while True:
        if await job_of(db, key) is not None:
            return
        if time.monotonic() >= until:
            raise AssertionError(f"{key!r} was never claimed")
        await asyncio.sleep(0.02)


async def until_true(condition: Callable[[], bool], *, deadline: float = 5.0) -> None:
    until = time.monotonic() + deadline
    while not condition():
        if time.monotonic() >= until:
            raise AssertionError("the condition did not come true in time")
        await asyncio.sleep(0.01)


async def no_leak(db: FaultDatabase) -> None:
    connections = await settled_connections(db.proxy_connections, CONNECTIONS_MAX)
    assert connections <= CONNECTIONS_MAX, await db.server.backends(db.name)


# -- one session killed at each step of a request ----------------------------------------------


async def test_killed_at_the_claim(
    proxy_app: StartApp, fault_db: FaultDatabase, recording_backend: tuple[str, Ledger]
) -> None:
    ledger = recording_backend[1]
    client = await proxy_app()
    url = f"http://{client.server.host}:{client.server.port}"
    async with aiohttp.ClientSession() as session:
        async with jobs_locked(fault_db):
            request = asyncio.create_task(send(session, url, "claim"))
            pid = await blocked_backend(fault_db, CLAIM_SQL)
            assert await fault_db.server.terminate_backends(pids=[pid]) == [pid]
            answer = await request
        # The claim's transaction died with its session: no job, nothing forwarded.
        left, forwarded = await job_of(fault_db, "claim"), ledger.count()
        retry = await send(session, url, "claim")

    assert (answer.status, answer.error) == (503, "store-unavailable"), answer
    assert answer.retry_after is not None
    assert (left, forwarded) == (None, 0)
    assert (retry.status, retry.replayed) == (201, False), retry
    assert ledger.count("claim") == 1
    assert await job_of(fault_db, "claim") == ("completed", [("succeeded", None)])
    await no_leak(fault_db)


async def test_killed_between_claim_and_completion(
    proxy_app: StartApp, fault_db: FaultDatabase, recording_backend: tuple[str, Ledger]
) -> None:
    """Every session of the proxy (pool and listener) is killed while the upstream works."""
    ledger = recording_backend[1]
    client = await proxy_app()
    url = f"http://{client.server.host}:{client.server.port}"
    path = PATH + "?delay=0.5"
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(send(session, url, "between", path=path))
        await until_claimed(fault_db, "between")  # the upstream call runs now
        killed = await fault_db.server.terminate_backends(
            fault_db.name, application_name=APPLICATION_NAME
        )
        answer = await request
        retry = await send(session, url, "between", path=path)

    assert killed, "the proxy held no session to kill"
    # The pool noticed its sessions had gone and the completion took a fresh one.
    assert (answer.status, answer.replayed) == (201, False), answer
    assert (retry.status, retry.replayed, retry.execution) == (201, True, answer.execution)
    assert ledger.count("between") == 1
    await no_leak(fault_db)


async def test_killed_during_the_completion(
    proxy_app: StartApp, fault_db: FaultDatabase, recording_backend: tuple[str, Ledger]
) -> None:
    """SPEC §3.2, §3.5: the upstream ran, its outcome could not be stored, and the client got
    503. The proxy keeps the outcome and writes it by the attempt's compare-and-swap once the
    store answers (proxy/background/unwritten.py), well within the lease: retries get the replay of
    the one execution, never a second one (before, the job became `unknown` after its lease)."""
    ledger = recording_backend[1]
    client = await proxy_app()
    url = f"http://{client.server.host}:{client.server.port}"
    unwritten = client.app[CONTEXT].unwritten
    path = PATH + "?delay=0.2"
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(send(session, url, "complete", path=path))
        await until_claimed(fault_db, "complete")  # the upstream call runs now
        async with jobs_locked(fault_db):
            pid = await blocked_backend(fault_db, COMPLETE_SQL)
            await fault_db.server.terminate_backends(pids=[pid])
            answer = await request
        await until_true(lambda: len(unwritten) == 0)
        retry = await send(session, url, "complete", path=path)

    assert (answer.status, answer.error) == (503, "store-unavailable"), answer
    assert await job_of(fault_db, "complete") == ("completed", [("succeeded", None)])
    assert (retry.status, retry.replayed) == (201, True), retry
    assert ledger.count("complete") == 1
    assert retry.execution == 1
    await no_leak(fault_db)


async def test_lost_completion_does_not_claim_nothing_was_forwarded(
    proxy_app: StartApp, fault_db: FaultDatabase, recording_backend: tuple[str, Ledger]
) -> None:
    client = await proxy_app()
    url = f"http://{client.server.host}:{client.server.port}"
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(
            session.post(
                url + PATH + "?delay=0.2",
                data=b"{}",
                headers={"Idempotency-Key": "detail", "Content-Type": "application/json"},
            )
        )
        # Claimed first: a lock taken before the claim would stall the claim, not the completion.
        await until_claimed(fault_db, "detail")
        async with jobs_locked(fault_db):
            pid = await blocked_backend(fault_db, COMPLETE_SQL)
            await fault_db.server.terminate_backends(pids=[pid])
            response = await request
            problem = await response.json(content_type=None)
            response.release()
    assert recording_backend[1].count("detail") == 1
    assert response.status == 503
    assert "not forwarded" not in problem["detail"], problem


# -- restarts and crashes under traffic --------------------------------------------------------


async def under_traffic(
    proxy_url: str, db: FaultDatabase, ledger: Ledger, fault: Callable[[], Awaitable[None]]
) -> dict[str, int]:
    """Traffic, `fault()` in the middle of it, the verdict; the answer summary."""
    path = PATH + "?delay=0.05"
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        load = asyncio.create_task(traffic(session, proxy_url, "r", stop, path=path))
        await asyncio.sleep(0.5)
        await fault()
        await asyncio.sleep(1.0)
        stop.set()
        answers = await load
        await asyncio.sleep(LEASE)
        retries = await retry_all(session, proxy_url, sorted(keys_of(answers)), path=path)
        fresh = await send(session, proxy_url, "fresh")

    await assert_one_job_per_intent(answers + retries, ledger, db.admin_dsn)
    assert not after_the_lease(retries), (summary(retries), after_the_lease(retries)[:10])
    slow = [a for a in answers if a.status != 201 and a.seconds > ANSWER_LIMIT]
    assert not slow, slow[:10]
    assert (fresh.status, fresh.replayed) == (201, False), fresh
    await no_leak(db)
    return summary(answers)


@pytest.mark.parametrize(
    ("kind", "how", "commit"),
    [
        ("app", "fast", "on"),
        ("process", "immediate", "on"),
        ("app", "kill9", "on"),
        # A DBA's throughput setting on the database: the store must not let it drop claims.
        ("process", "kill9", "off"),
    ],
)
async def test_restart_under_traffic(
    kind: str,
    how: str,
    commit: str,
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
) -> None:
    await fault_db.server.execute(
        f'ALTER DATABASE "{fault_db.name}" SET synchronous_commit = {commit}'
    )
    proxy = await governed_proxy(kind, max_wait=3.0)
    pg = fault_db.server

    async def fault() -> None:
        if how == "kill9":
            await asyncio.to_thread(pg.kill9)
            await asyncio.to_thread(pg.start)  # crash recovery
        else:
            await asyncio.to_thread(pg.restart, how)

    kinds = await under_traffic(proxy.url, fault_db, recording_backend[1], fault)
    assert kinds.get("executed") and kinds.get("replayed"), kinds


# -- stalls: a lock, a frozen server -----------------------------------------------------------


@pytest.mark.parametrize("stall", ["table-lock", "sigstop"])
async def test_stall_under_traffic(
    stall: str,
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
) -> None:
    """Longer than pool.store_timeout: bounded 503s while it lasts, then service as before."""
    proxy = await governed_proxy("app", max_wait=3.0)
    pg = fault_db.server

    async def fault() -> None:
        if stall == "sigstop":
            pg.pause()
            await asyncio.sleep(1.5)
            pg.resume()
        else:
            async with jobs_locked(fault_db):
                await asyncio.sleep(1.5)

    kinds = await under_traffic(proxy.url, fault_db, recording_backend[1], fault)
    assert kinds.get("503 store-unavailable"), f"the stall was not seen: {kinds}"


async def test_sigterm_while_the_store_is_frozen(
    governed_proxy: GovernedProxy, fault_db: FaultDatabase
) -> None:
    """A proxy told to stop while PostgreSQL does not answer still exits, in bounded time."""
    proxy = await governed_proxy("process")
    assert proxy.process is not None
    async with aiohttp.ClientSession() as session:
        assert (await send(session, proxy.url, "warm")).status == 201
        fault_db.server.pause()
        try:
            frozen = await send(session, proxy.url, "frozen")
            stopped_at = time.monotonic()
            code = await proxy.process.terminate(timeout=8.0)
            took = time.monotonic() - stopped_at
        finally:
            fault_db.server.resume()
    assert (frozen.status, frozen.error) == (503, "store-unavailable"), frozen
    assert code == 0, proxy.process.describe()
    assert took < 5.0, proxy.process.describe()


async def test_claim_answered_after_the_timeout(
    proxy_app: StartApp, fault_db: FaultDatabase, recording_backend: tuple[str, Ledger]
) -> None:
    """A claim sent to a frozen server times out (503, nothing forwarded), but the server may
    still commit it once it runs again (with SIGSTOP it does, nearly every time). Nobody could
    tell that job from one whose proxy died mid-attempt, and after its lease it would be taken
    over as `unknown`; the proxy that gave up on the claim knows nothing was forwarded, and
    releases it as soon as the server answers (proxy/background/unsent.py). The retry runs it,
    once."""
    ledger = recording_backend[1]
    client = await proxy_app()
    url = f"http://{client.server.host}:{client.server.port}"
    unsent = client.app[CONTEXT].unsent
    async with aiohttp.ClientSession() as session:
        assert (await send(session, url, "warm")).status == 201  # pooled sessions are open
        fault_db.server.pause()
        try:
            answer = await send(session, url, "late")
        finally:
            fault_db.server.resume()
        await until_true(lambda: len(unsent) == 0, deadline=LEASE + 5.0)
        left = await job_of(fault_db, "late")
        await asyncio.sleep(LEASE)  # past the lease: the job is not taken over either
        retry = await send(session, url, "late")

    assert (answer.status, answer.error) == (503, "store-unavailable"), answer
    assert answer.seconds < ANSWER_LIMIT, answer
    # The claim committed after its 503 and was released, or the cancel won and it never did.
    assert left in (None, ("released", [("failed", NEVER_FORWARDED)])), left
    assert (retry.status, retry.replayed) == (201, False), retry
    assert ledger.count("late") == 1
    await no_leak(fault_db)


async def test_change_feed_survives_a_black_hole(
    proxy_app: StartApp,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replica B's sessions die silently (a network path gone, no FIN, no RST). Its pool
    replaces them after a few 503s; its change feed must notice too (heartbeat with a timeout),
    or B's held duplicates learn of other replicas' completions only by polling."""
    monkeypatch.setattr(pg_listen, "_HEARTBEAT_SECONDS", 0.3)  # noticed in 0.3 s + store_timeout
    ledger = recording_backend[1]
    relay = Relay(fault_db.server.port)
    await relay.start()
    try:
        a = await proxy_app()
        b = await proxy_app(store=fault_db.dsn_via(relay.port))
        a_url, b_url = (f"http://{c.server.host}:{c.server.port}" for c in (a, b))
        path = PATH + "?delay=1.0"
        # B's pool opened its two floor sessions during start-up; its change feed connects in
        # the background and then LISTENs: the black hole must swallow that session too.
        await until_true(lambda: relay.connections >= 3)
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as session:
            relay.blackhole()
            healed = await until_executed(session, b_url, "b-heals")
            await asyncio.sleep(1.0)  # B's feed: heartbeat, its timeout, close, reconnect
            first = asyncio.create_task(send(session, a_url, "shared", path=path))
            await until_claimed(fault_db, "shared")
            held = await send(session, b_url, "shared", path=path)  # A completes it
            ran = await first
    finally:
        await relay.close()

    assert healed.status == 201, healed
    assert (held.status, held.replayed, held.execution) == (201, True, ran.execution), held
    # Woken by A's NOTIFY, not by B's WAITER_RECHECK_SECONDS poll.
    assert held.seconds - ran.seconds < 0.5, (held, ran)
    assert ledger.count("shared") == 1
    await no_leak(fault_db)
