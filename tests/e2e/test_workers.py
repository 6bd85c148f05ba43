"""`idemproxy serve --workers 2`: real supervisor and worker processes, real signals.

Connections are spread by the kernel (SO_REUSEPORT) by a hash of their addresses, so the tests
open a new connection per request and count, from worker 0's merged /metrics, where requests
landed: with n connections, all on one worker has probability 2^(1-n).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from idemproxy.constants import WAITER_RECHECK_SECONDS
from idemproxy.workers.role import WORKER_ROLE_FLAG, WorkerRole
from tests.support.client import send

from .conftest import START_DEADLINE, free_port

if TYPE_CHECKING:
    from .conftest import Backend, ProxyProcess, RunCli, StartProxy

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

WORKERS = "2"
SHUTDOWN_TIMEOUT = 5.0
# As in test_replicas: LISTEN/NOTIFY wakes a duplicate held on the other worker, well before
# its periodic re-read would.
WAKE_BUDGET = 1.0
EXIT_DEADLINE = 10.0


# --- process helpers --------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name; None for a gone or zombie process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields


def alive(pid: int) -> bool:
    return _stat(pid) is not None


def role_of(pid: int) -> WorkerRole | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    flag = WORKER_ROLE_FLAG.encode()
    if flag not in argv:
        return None
    return WorkerRole.from_arg(argv[argv.index(flag) + 1].decode())


def workers_of(supervisor: int) -> dict[int, int]:
    """Worker index → pid, for the live children of `supervisor`."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None and int(fields[1]) == supervisor:
            role = role_of(int(entry.name))
            if role is not None:
                found[role.index] = int(entry.name)
    return found


@contextlib.contextmanager
def killed_at_exit(pids: list[int]) -> Iterator[None]:
    """Workers a test orphaned (their supervisor SIGKILLed) never outlive the test."""
    try:
        yield
    finally:
        for pid in pids:
            if alive(pid) and role_of(pid) is not None:
                os.kill(pid, signal.SIGKILL)


async def until(predicate_pids: list[int], *, gone: bool, deadline: float) -> bool:
    until_at = time.monotonic() + deadline
    while time.monotonic() < until_at:
        if all(alive(pid) != gone for pid in predicate_pids):
            return True
        await asyncio.sleep(0.05)
    return False


# --- admin helpers ----------------------------------------------------------------------------


async def readyz(proxy: ProxyProcess) -> tuple[int, dict[str, object]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{proxy.admin_url}/readyz") as response,
    ):
        return response.status, await response.json()


async def until_all_ready(proxy: ProxyProcess) -> None:
    """Port accepting is not enough: worker 0's /readyz is 200 once every worker serves."""
    until_at = time.monotonic() + START_DEADLINE
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            if (await readyz(proxy))[0] == 200:
                return
        assert time.monotonic() < until_at, f"not ready: {proxy.describe()}"
        assert proxy.running, proxy.describe()
        await asyncio.sleep(0.1)


async def series(proxy: ProxyProcess, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{proxy.admin_url}/metrics") as response,
    ):
        text = await response.text()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def requests_by_worker(proxy: ProxyProcess, outcome: str) -> dict[str, float]:
    found = await series(proxy, "idemproxy_requests_total")
    by_worker: dict[str, float] = {}
    for labels, value in found.items():  # summed over the status classes and sources
        if dict(labels)["outcome"] == outcome:
            worker = dict(labels)["worker"]
            by_worker[worker] = by_worker.get(worker, 0.0) + value
    return by_worker


async def start_workers(
    start_proxy: StartProxy, backend: Backend, dsn: str, env: dict[str, str] | None = None
) -> ProxyProcess:
    proxy = await start_proxy(
        "--upstream", backend.url, "--store", dsn, "--workers", WORKERS, env=env, name="super"
    )
    await until_all_ready(proxy)
    assert sorted(workers_of(proxy.pid)) == [0, 1], proxy.describe()
    return proxy


def one_connection_each() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


# --- tests ------------------------------------------------------------------------------------


async def test_two_workers_answer_on_one_port_and_one_admin_endpoint(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    proxy = await start_workers(start_proxy, backend, pg_dsn)
    sent = 40
    async with one_connection_each() as session:
        answers = [await send(session, f"{proxy.url}/notes") for _ in range(sent)]
    assert {a.status for a in answers} == {201}

    by_worker = await requests_by_worker(proxy, "passthrough")
    assert set(by_worker) == {"0", "1"}
    assert sum(by_worker.values()) == sent
    assert min(by_worker.values()) > 0, f"every request landed on one worker: {by_worker}"
    up = await series(proxy, "idemproxy_worker_up")
    assert up == {(("worker", "0"),): 1, (("worker", "1"),): 1}
    # A store-wide gauge is reported once, not per worker.
    assert list(await series(proxy, "idemproxy_unknown_jobs")) == [()]
    # Each worker's process series are its own, under its label, never summed into one.
    for name in ("process_resident_memory_bytes", "process_start_time_seconds"):
        assert set(await series(proxy, name)) == {(("worker", "0"),), (("worker", "1"),)}, name
    # Each worker times its own event loop (observe/metrics.py), ten timers a second.
    lags = await series(proxy, "idemproxy_event_loop_lag_seconds_count")
    assert set(lags) == {(("worker", "0"),), (("worker", "1"),)} and min(lags.values()) > 0
    pauses = await series(proxy, "idemproxy_gc_pause_seconds_count")
    assert {dict(labels)["generation"] for labels in pauses} == {"0", "1", "2"}


async def test_readyz_waits_for_every_worker(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    proxy = await start_workers(start_proxy, backend, pg_dsn)
    other = workers_of(proxy.pid)[1]
    os.kill(other, signal.SIGSTOP)  # alive but not answering: as a worker stuck in a busy loop
    try:
        status, body = await readyz(proxy)
        assert (status, body) == (503, {"status": "worker-not-ready", "worker": 1})
        up = await series(proxy, "idemproxy_worker_up")
        assert up == {(("worker", "0"),): 1, (("worker", "1"),): 0}
    finally:
        os.kill(other, signal.SIGCONT)
    assert (await readyz(proxy))[0] == 200


async def test_a_duplicate_held_on_one_worker_is_woken_by_the_other(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    assert WAKE_BUDGET < WAITER_RECHECK_SECONDS - 0.3
    proxy = await start_workers(start_proxy, backend, pg_dsn)
    key = "order-7"
    async with one_connection_each() as session:
        answers = await asyncio.gather(
            *(send(session, f"{proxy.url}/payments?delay=0.3", key=key) for _ in range(20))
        )

    assert backend.ledger.count(key) == 1
    assert {a.status for a in answers} == {201}
    assert len({a.body for a in answers}) == 1
    first = next(a for a in answers if not a.replayed)
    spread = max(a.done_at for a in answers) - first.done_at
    assert spread < WAKE_BUDGET, f"held duplicates woke after {spread:.2f}s"
    new = await requests_by_worker(proxy, "new")
    held = await requests_by_worker(proxy, "held")
    executing = next(worker for worker, count in new.items() if count == 1)
    others = [count for worker, count in held.items() if worker != executing]
    assert sum(others) > 0, f"no duplicate was held on the other worker: new {new}, held {held}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
async def test_sigterm_drains_every_worker_and_the_supervisor_exits_0(
    pg_dsn: str, signum: signal.Signals, backend: Backend, start_proxy: StartProxy
) -> None:
    env = {"IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT)}
    proxy = await start_workers(start_proxy, backend, pg_dsn, env)
    pids = list(workers_of(proxy.pid).values())
    count = 16
    async with one_connection_each() as session:
        requests = [
            asyncio.create_task(send(session, f"{proxy.url}/charges?delay=2.5", key=f"slow-{i}"))
            for i in range(count)
        ]
        await _until_in_flight(pg_dsn, count)
        signalled = time.monotonic()
        code = await proxy.terminate(timeout=SHUTDOWN_TIMEOUT + 5, signum=signum)
        stopped = time.monotonic() - signalled
        answers = await asyncio.gather(*requests)

    assert code == 0, proxy.describe()
    assert stopped < SHUTDOWN_TIMEOUT, f"exit took {stopped:.1f}s"
    assert [a.status for a in answers] == [201] * count, proxy.describe()
    assert backend.ledger.count() == count
    assert not any(alive(pid) for pid in pids)
    # Both workers had requests in flight, and both drained them.
    drained = re.findall(r"draining (\d+) requests", proxy.stderr())
    assert len(drained) == 2, proxy.describe()


async def test_a_killed_worker_stops_the_others_and_the_supervisor_exits_1(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    proxy = await start_workers(start_proxy, backend, pg_dsn)
    workers = workers_of(proxy.pid)
    os.kill(workers[1], signal.SIGKILL)

    assert await proxy.wait_exit(EXIT_DEADLINE) == 1, proxy.describe()
    assert not alive(workers[0])
    assert "worker 1" in proxy.stderr()
    assert "exited unexpectedly" in proxy.stderr()


async def test_workers_stop_when_their_supervisor_is_killed(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    proxy = await start_workers(start_proxy, backend, pg_dsn)
    pids = list(workers_of(proxy.pid).values())
    with killed_at_exit(pids):
        proxy.kill()
        assert await until(pids, gone=True, deadline=EXIT_DEADLINE), [
            (pid, alive(pid)) for pid in pids
        ]


async def _until_in_flight(dsn: str, count: int, deadline: float = 5.0) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        until_at = time.monotonic() + deadline
        query = "SELECT count(*) FROM idemproxy.jobs WHERE state = 'in_flight'"
        while await conn.fetchval(query) < count:
            assert time.monotonic() < until_at, "the requests never reached the proxy"
            await asyncio.sleep(0.02)
    finally:
        await conn.close()


async def test_a_second_group_on_a_taken_port_fails_as_a_single_process_does(
    pg_dsn: str,
    empty_pg_dsn: str,
    backend: Backend,
    start_proxy: StartProxy,
    run_cli: RunCli,
) -> None:
    """SO_REUSEPORT let a second `--workers` group (here with another store) join the port:
    each group executed the same key once. Now it is refused before it migrates or starts a
    worker, as a single process is refused, and the first group serves on."""
    first = await start_workers(start_proxy, backend, pg_dsn)
    taken = ["--listen", f"127.0.0.1:{first.port}", "--admin-listen", f"127.0.0.1:{free_port()}"]
    common = ["--upstream", backend.url, "--store", empty_pg_dsn]
    for extra in (["--workers", WORKERS], []):
        done = run_cli("serve", *taken, *common, *extra, timeout=20)
        assert done.returncode == 1, done
        assert "idemproxy: listen: " in done.stderr, done.stderr
        assert f"127.0.0.1:{first.port}" in done.stderr
        assert "already in use" in done.stderr.lower()
        assert "Traceback" not in done.stderr, done.stderr
    assert not await _has_schema(empty_pg_dsn), "the refused group migrated its store"
    async with one_connection_each() as session:
        answer = await send(session, first.url + "/charges", key="after-refusal")
    assert answer.status == 201
    assert alive(first.pid) and sorted(workers_of(first.pid)) == [0, 1]


async def _has_schema(dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return bool(
            await conn.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = 'idemproxy'")
        )
    finally:
        await conn.close()
