"""SIGTERM with a request in flight longer than the shutdown timeout (SPEC §3.2, §13).

The proxy stops accepting connections at once, says it is draining on /readyz, gives the
attempt `server.shutdown_timeout` seconds, then cuts it off: the upstream may have executed
it, so the job becomes `unknown` — never `released`, which would let a retry run it again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from idemproxy.core.types import AttemptState, Job, JobState
from idemproxy.identity.intent import hash_credential
from idemproxy.store.factory import create_store
from tests.support.client import Answer, send

if TYPE_CHECKING:
    from .conftest import Backend, ProxyProcess, StartProxy

pytestmark = pytest.mark.slow

SHUTDOWN_TIMEOUT = 1.0
# Longer than the time the attempt gets (the shutdown timeout), so that it is cut off rather
# than finishing while the proxy drains.
BACKEND_DELAY = 4.0
EXIT_LIMIT = SHUTDOWN_TIMEOUT + 5.0
# The test that looks at the proxy while it drains needs the drain to outlast its looking (a
# few polls, each slower on a busy machine) and the attempt to still be cut off.
OBSERVED_DRAIN = 3.0
assert OBSERVED_DRAIN < BACKEND_DELAY
OWNER = hash_credential("Bearer e2e-user")  # the Authorization header `client.send` sets
KEY = "drain-1"
PATH = f"/charges?delay={BACKEND_DELAY}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/idemproxy.db"
    pg: str = request.getfixturevalue("pg_dsn")
    return pg


async def test_sigterm_cuts_off_a_slow_attempt_as_unknown(
    dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    args = ("--upstream", backend.url, "--store", dsn)
    proxy = await start_proxy(
        *args, env={"IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT)}
    )
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(_send_or_error(session, proxy.url + PATH))
        in_flight = await _until_in_flight(dsn)
        sent_at = time.monotonic()

        signalled = time.monotonic()
        code = await proxy.terminate(timeout=EXIT_LIMIT + 5)
        stopped = time.monotonic() - signalled
        outcome = await first

        assert code == 0, proxy.describe()
        assert stopped < EXIT_LIMIT, f"exit took {stopped:.1f}s: {proxy.describe()}"
        # It did wait for the attempt before cutting it off.
        assert stopped >= SHUTDOWN_TIMEOUT * 0.9, f"exit took only {stopped:.1f}s"
        # The first client never gets a made-up answer: no 2xx, no replayable result.
        if isinstance(outcome, Answer):
            assert outcome.status >= 500, (outcome.status, outcome.body)

        job = await _job(dsn)
        assert (job.id, job.state) == (in_flight.id, JobState.UNKNOWN), job
        assert (job.response, job.completed_by, job.version) == (None, None, in_flight.version + 1)
        [attempt] = job.attempts
        assert attempt.state is AttemptState.UNKNOWN, attempt
        assert attempt.error is not None and "shutdown" in attempt.error, attempt
        assert attempt.finished_at is not None

        restarted = await start_proxy(*args, name="restarted")
        retry = await send(session, restarted.url + PATH, key=KEY)
        assert (retry.status, retry.error) == (409, "outcome-unknown"), restarted.describe()
        assert json.loads(retry.body)["code"] == "outcome-unknown"

        # The upstream got the request and finishes it on its own time: once, and only once.
        await asyncio.sleep(max(0.0, sent_at + BACKEND_DELAY + 0.3 - time.monotonic()))
        assert backend.ledger.count(KEY) == 1
        again = await send(session, restarted.url + PATH, key=KEY)
    assert (again.status, again.error) == (409, "outcome-unknown"), restarted.describe()
    assert backend.ledger.count(KEY) == 1
    assert (await _job(dsn)).state is JobState.UNKNOWN


async def test_an_attempt_is_cut_off_after_the_shutdown_timeout(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy
) -> None:
    dsn = f"sqlite:///{tmp_path}/idemproxy.db"
    proxy = await start_proxy(
        "--upstream",
        backend.url,
        "--store",
        dsn,
        env={"IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT)},
    )
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(_send_or_error(session, proxy.url + PATH))
        await _until_in_flight(dsn)
        signalled = time.monotonic()
        assert await proxy.terminate(timeout=EXIT_LIMIT + 5) == 0, proxy.describe()
        stopped = time.monotonic() - signalled
        await first
    assert (await _job(dsn)).state is JobState.UNKNOWN
    # SPEC/server.py: attempts get `shutdown_timeout`, then are cut off and the process exits.
    assert stopped < SHUTDOWN_TIMEOUT + 1.0, f"exit took {stopped:.1f}s"


async def test_sigterm_closes_the_listener_and_turns_readyz_to_draining(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy
) -> None:
    dsn = f"sqlite:///{tmp_path}/idemproxy.db"
    proxy = await start_proxy(
        "--upstream",
        backend.url,
        "--store",
        dsn,
        env={"IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": str(OBSERVED_DRAIN)},
    )
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{proxy.admin_url}/readyz") as ready:
            assert (ready.status, await ready.json()) == (200, {"status": "ready", "store": "ok"})
        # A request in flight keeps the process draining for a while (2 x the timeout).
        first = asyncio.create_task(_send_or_error(session, proxy.url + PATH))
        await _until_in_flight(dsn)

        os.kill(proxy.pid, signal.SIGTERM)
        draining = await _until_draining(session, proxy)
        assert draining == {"status": "draining"}, proxy.describe()
        refused = await _until_refused(proxy)
        assert refused, f"the proxy still accepted connections while draining: {proxy.describe()}"
        assert proxy.running, "the process was meant to still be draining"
        async with session.get(f"{proxy.admin_url}/healthz") as health:
            assert health.status == 200  # alive: draining is not a reason to restart it

        code = await proxy.wait_exit(OBSERVED_DRAIN + EXIT_LIMIT)
        await first
    assert code == 0, proxy.describe()
    job = await _job(dsn)
    assert job.state is JobState.UNKNOWN


# --- helpers ----------------------------------------------------------------------------------


async def _send_or_error(session: aiohttp.ClientSession, url: str) -> Answer | Exception:
    """The first client's fate: an answer, or the connection dropped under it."""
    try:
        return await send(session, url, key=KEY)
    except aiohttp.ClientError as exc:
        return exc


async def _until_in_flight(dsn: str, deadline: float = 5.0) -> Job:
    """The claim is committed before a byte goes upstream (SPEC §2.2): wait for it to show."""
    store = create_store(dsn)
    await store.open()
    try:
        until = time.monotonic() + deadline
        while (job := await store.get(OWNER, KEY)) is None:
            assert time.monotonic() < until, "the request never reached the proxy"
            await asyncio.sleep(0.02)
    finally:
        await store.close()
    assert job.state is JobState.IN_FLIGHT, job
    return job


async def _until_draining(
    session: aiohttp.ClientSession, proxy: ProxyProcess, deadline: float = 3.0
) -> object:
    until = time.monotonic() + deadline
    while True:
        async with session.get(f"{proxy.admin_url}/readyz") as ready:
            if ready.status == 503 or time.monotonic() >= until:
                return await ready.json()
        await asyncio.sleep(0.02)


async def _until_refused(proxy: ProxyProcess, deadline: float = 1.0) -> bool:
    """True once a new connection to the proxy's port is refused."""
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        except ConnectionRefusedError:
            return True
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.02)
    return False


async def _job(dsn: str) -> Job:
    store = create_store(dsn)
    await store.open()
    try:
        found = await store.get(OWNER, KEY)
        assert found is not None
        job = await store.get_by_id(found.id)
    finally:
        await store.close()
    assert job is not None
    return job
