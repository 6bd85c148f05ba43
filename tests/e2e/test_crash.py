"""A proxy killed with SIGKILL mid-request (SPEC §3.2, §3.5): real processes, real crashes.

`IDEMPROXY_TEST_FAILPOINT` makes `idemproxy serve` SIGKILL itself at one point of its first
governed request. A proxy without it is then started on the same store and the client retries:

* the response was stored (`after_store`): the retry gets it replayed;
* otherwise nobody can know whether the upstream executed the intent: once the dead proxy's
  lease ran out (by the database clock), the retry takes the job over as `unknown` and gets
  `409 outcome-unknown` — never a second execution.

Leases are 1 s so that each crash costs about a second of waiting.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from idemproxy.core.types import AttemptState, Job, JobState, StoredResponse
from idemproxy.identity.intent import hash_credential
from idemproxy.proxy.failpoints import ENV as FAILPOINT_ENV
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from tests.support.client import Answer, send

if TYPE_CHECKING:
    from .conftest import Backend, ProxyProcess, RunCli, StartProxy

pytestmark = pytest.mark.slow

LEASE = 1.0
# A renewal must fit in the lease (config/settings.py refuses store_timeout >= 2/3 of it).
STORE_ENV = {"IDEMPROXY_POOL__STORE_TIMEOUT": "0.5"}
OWNER = hash_credential("Bearer e2e-user")  # the Authorization header `client.send` sets
KEY = "crash-1"
SIGKILL_STATUS = -9  # subprocess: killed by signal 9
DEATH_DEADLINE = 10.0
# A held retry re-reads its job every WAITER_RECHECK_SECONDS (2 s) when nothing wakes it: an
# expired lease wakes nobody, so the hold ends within lease + 2 s (+ slack for slow machines).
HOLD_LIMIT = LEASE + 2.0 + 3.0
# What each crash point leaves behind: how many times the backend executed the request, the
# job state right after the crash, and the attempt state.
AFTER_CRASH = {
    "after_claim": (0, JobState.IN_FLIGHT, AttemptState.STARTED),
    "after_send": (1, JobState.IN_FLIGHT, AttemptState.STARTED),
    "before_store": (1, JobState.IN_FLIGHT, AttemptState.STARTED),
    "after_store": (1, JobState.COMPLETED, AttemptState.SUCCEEDED),
}
# after_send: the backend takes its time, so the proxy dies while the upstream call runs.
PATHS = {"after_send": "/charges?delay=0.3"}


@pytest.fixture
def sqlite_store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/idemproxy.db"


CASES = [
    pytest.param("postgres", point, marks=pytest.mark.postgres, id=f"postgres-{point}")
    for point in AFTER_CRASH
] + [pytest.param("sqlite", point, id=f"sqlite-{point}") for point in ("after_send", "after_store")]


@pytest.fixture
def store_of(request: pytest.FixtureRequest) -> str:
    fixture = {"postgres": "pg_dsn", "citus": "citus_dsn", "sqlite": "sqlite_store"}[request.param]
    dsn: str = request.getfixturevalue(fixture)
    return dsn


@pytest.mark.parametrize(("store_of", "point"), CASES, indirect=["store_of"])
async def test_crash_then_retry_never_executes_twice(
    store_of: str, point: str, backend: Backend, start_proxy: StartProxy
) -> None:
    dsn = store_of
    path = PATHS.get(point, "/charges")
    args = ("--upstream", backend.url, "--store", dsn, "--lease", str(LEASE))
    victim = await start_proxy(
        *args, env={**STORE_ENV, FAILPOINT_ENV: point}, name=f"victim-{point}"
    )

    async with aiohttp.ClientSession() as session:
        await crash(session, victim, path)
        executions, state, attempt_state = AFTER_CRASH[point]
        await until_executed(backend, executions)
        crashed = await job_in(dsn)
        assert crashed.state is state, crashed
        assert [(a.number, a.state) for a in crashed.attempts] == [(1, attempt_state)]

        # The same address, a new process without the failpoint, the same store.
        restarted = await start_proxy(*args, env=STORE_ENV, port=victim.port, name="restarted")
        retry = await send(session, restarted.url + path, key=KEY)
        again = await send(session, restarted.url + path, key=KEY)

    if point == "after_store":
        # The response was stored before the client lost it: every retry gets it (SPEC §7).
        assert (retry.status, retry.replayed, retry.job) == (201, True, crashed.id), describe(
            retry, restarted
        )
        assert json.loads(retry.body)["execution"] == 1
        assert isinstance(crashed.response, StoredResponse) and retry.body == crashed.response.body
        assert (again.status, again.body, again.replayed) == (201, retry.body, True)
        final = await job_in(dsn)
        assert (final.state, final.version) == (JobState.COMPLETED, crashed.version)
    else:
        for answer in (retry, again):
            assert_outcome_unknown(answer, restarted)
        # Only the first retry could have been held: the takeover answers every later one.
        assert again.done_at - again.sent_at < 1.0
        final = await job_in(dsn)
        assert_taken_over(final, crashed)
    assert backend.ledger.count(KEY) == executions, restarted.describe()


@pytest.mark.postgres
async def test_a_retry_before_the_lease_runs_out_is_held_or_told_in_flight(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    """Replicas that are up while the victim dies: the lease has not run out when they retry."""
    args = ("--upstream", backend.url, "--store", pg_dsn, "--lease", str(LEASE))
    victim, patient, impatient = await asyncio.gather(
        start_proxy(*args, env={**STORE_ENV, FAILPOINT_ENV: "after_claim"}, name="victim"),
        start_proxy(*args, env=STORE_ENV, name="patient"),
        start_proxy(*args, "--max-wait", "0.2", env=STORE_ENV, name="impatient"),
    )
    async with aiohttp.ClientSession() as session:
        await crash(session, victim, "/charges")
        crashed = await job_in(pg_dsn)
        assert not crashed.lease_expired, "the retries were meant to come before the expiry"
        held, refused = await asyncio.gather(
            send(session, f"{patient.url}/charges", key=KEY),
            send(session, f"{impatient.url}/charges", key=KEY),
        )
        late = await send(session, f"{impatient.url}/charges", key=KEY)

    # max_wait passed before the lease ran out: the job is still in flight as far as anyone knows.
    assert (refused.status, refused.error) == (409, "request-in-flight"), describe(
        refused, impatient
    )
    assert refused.headers.get("Retry-After") == "1"
    assert refused.done_at - refused.sent_at < LEASE
    # The default waits for the job (SPEC §2.3); the expired lease ends the wait with a takeover.
    assert_outcome_unknown(held, patient)
    assert held.done_at - held.sent_at < HOLD_LIMIT
    assert_outcome_unknown(late, impatient)
    final = await job_in(pg_dsn)
    assert_taken_over(final, crashed)
    # The takeover came no earlier than the lease allowed, by the database clock.
    assert final.updated_at is not None and crashed.created_at is not None
    assert final.updated_at - crashed.created_at >= timedelta(seconds=LEASE)
    assert held.done_at - held.sent_at >= 0.5
    assert backend.ledger.count(KEY) == 0


# With no retry at all: the running proxies take the dead one's job over in the background.
TAKEOVER_ENV = {**STORE_ENV, "IDEMPROXY_SWEEPER__TAKEOVER_INTERVAL": "0.2"}
# docs/operations.md: unknown within 2 x lease + sweeper.takeover_interval of the death.
TAKEOVER_BOUND = 2 * LEASE + 0.2


@pytest.mark.parametrize(
    "store_of",
    [
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("citus", marks=pytest.mark.citus),
        "sqlite",
    ],
    indirect=True,
)
async def test_a_killed_proxys_job_becomes_unknown_with_no_retry(
    store_of: str, backend: Backend, start_proxy: StartProxy, run_cli: RunCli
) -> None:
    """The job of a proxy SIGKILLed mid-attempt is `unknown` within the documented bound,
    listed, counted and resolvable, though no client ever retries its key. On PostgreSQL
    another replica that was up all along takes it over; on SQLite (one process) the proxy
    started again on the same file does."""
    dsn = store_of
    args = ("--upstream", backend.url, "--store", dsn, "--lease", str(LEASE))
    victim = await start_proxy(*args, env={**STORE_ENV, FAILPOINT_ENV: "after_send"}, name="victim")
    survivor = None
    if dsn.startswith("postgresql"):
        survivor = await start_proxy(*args, env=TAKEOVER_ENV, name="survivor")
    async with aiohttp.ClientSession() as session:
        await crash(session, victim, PATHS["after_send"])
        swept_since = time.monotonic()  # the death, with the survivor up all along
        await until_executed(backend, 1)
        crashed = await job_in(dsn)
        assert crashed.state is JobState.IN_FLIGHT, crashed
        if survivor is None:
            survivor = await start_proxy(*args, env=TAKEOVER_ENV, name="restarted")
            # One process on SQLite: nothing sweeps until it is back, and the bound runs from
            # then (a loaded machine may take seconds to start it), not from the death.
            swept_since = time.monotonic()
        final = await until_unknown(dsn, swept_since + TAKEOVER_BOUND + 3.0)
        assert_taken_over(final, crashed)
        # The takeover commits, then the gauge is set from a count of its own (a statement
        # more): a scrape in between still reads the count before it.
        metrics = await until_metrics(session, survivor.admin_url, "idemproxy_unknown_jobs 1.0")
    assert "idemproxy_unknown_jobs 1.0" in metrics, metrics
    assert "idemproxy_orphans_taken_over_total 1.0" in metrics, metrics

    listed = run_cli("jobs", "list", "--store", dsn, "--state", "unknown", "--json")
    assert listed.returncode == 0, listed
    assert [job["id"] for job in json.loads(listed.stdout)] == [crashed.id]
    resolved = run_cli("jobs", "resolve", crashed.id, "--store", dsn, "--as", "released")
    assert resolved.returncode == 0, resolved
    assert backend.ledger.count(KEY) == 1


# --- helpers ----------------------------------------------------------------------------------


async def crash(session: aiohttp.ClientSession, victim: ProxyProcess, path: str) -> None:
    """Send the request that trips the failpoint; the client sees the connection drop."""
    with pytest.raises(aiohttp.ClientError):
        answer = await send(session, victim.url + path, key=KEY)
        pytest.fail(f"the victim answered {answer.status}: {victim.describe()}")
    code = await victim.wait_exit(DEATH_DEADLINE)
    assert code == SIGKILL_STATUS, victim.describe()


async def until_metrics(
    session: aiohttp.ClientSession, admin_url: str, line: str, deadline: float = 5.0
) -> str:
    """The admin listener's /metrics once it holds `line`, or as it is after `deadline`."""
    until = time.monotonic() + deadline
    while True:
        metrics = await (await session.get(f"{admin_url}/metrics")).text()
        if line in metrics or time.monotonic() >= until:
            return metrics
        await asyncio.sleep(0.05)


async def until_executed(backend: Backend, count: int, deadline: float = 3.0) -> None:
    """Let a request that reached the backend finish there (its delay), then check the count."""
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        if backend.ledger.count(KEY) >= count:
            break
        await asyncio.sleep(0.02)
    if count == 0:
        await asyncio.sleep(0.1)  # nothing may be on its way either
    assert backend.ledger.count(KEY) == count


def assert_outcome_unknown(answer: Answer, proxy: ProxyProcess) -> None:
    assert (answer.status, answer.error) == (409, "outcome-unknown"), describe(answer, proxy)
    assert answer.headers["Content-Type"].startswith("application/problem+json")
    assert json.loads(answer.body)["code"] == "outcome-unknown"
    assert not answer.replayed


def assert_taken_over(final: Job, crashed: Job) -> None:
    """SPEC §3.5: the takeover marked the job and its attempt `unknown` by CAS on the version."""
    assert (final.id, final.state, final.version) == (
        crashed.id,
        JobState.UNKNOWN,
        crashed.version + 1,
    )
    assert (final.response, final.completed_by, final.lease_expired) == (None, None, False)
    assert [(a.number, a.state, a.status, a.error) for a in final.attempts] == [
        (1, AttemptState.UNKNOWN, None, "lease expired")
    ]
    assert final.attempts[0].finished_at is not None


async def job_in(dsn: str) -> Job:
    """The crash job, with its attempts, read straight from the store."""
    async with opened(dsn) as store:
        found = await store.get(OWNER, KEY)
        assert found is not None, "the claim was committed before anything went upstream"
        job = await store.get_by_id(found.id)
    assert job is not None
    return job


@asynccontextmanager
async def opened(dsn: str) -> AsyncIterator[Store]:
    store = create_store(dsn)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def until_unknown(dsn: str, deadline: float) -> Job:
    """Poll the store (bounded by `deadline`, time.monotonic()) until the crash job is unknown."""
    while True:
        job = await job_in(dsn)
        if job.state is JobState.UNKNOWN:
            return job
        assert time.monotonic() < deadline, f"still {job.state.value}: {job}"
        await asyncio.sleep(0.05)


def describe(answer: Answer, proxy: ProxyProcess) -> str:
    return f"{answer.status} {answer.headers} {answer.body[:500]!r}\n{proxy.describe()}"
