"""SIGTERM (or SIGHUP) with a governed request in flight: it finishes, its outcome is stored
(SPEC §2, §3.2, §8)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from idemproxy.core.types import AttemptState, Job, JobState
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from tests.support.client import send
from tests.support.ports import free_port
from tests.support.processes import (
    START_DEADLINE,
    STOP_DEADLINE,
    ProxyProcess,
    child_env,
)

if TYPE_CHECKING:
    from .conftest import Backend, StartProxy

pytestmark = pytest.mark.slow

SHUTDOWN_TIMEOUT = 5.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/idemproxy.db"
    pg: str = request.getfixturevalue("pg_dsn")
    return pg


# SIGHUP as SIGTERM: a closed terminal or a process manager's reload, which used to kill the
# process at once, the attempt in flight cut off (its job left in flight, then `unknown`).
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
async def test_sigterm_lets_the_request_in_flight_finish_and_store(
    dsn: str, signum: signal.Signals, backend: Backend, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(
        "--upstream",
        backend.url,
        "--store",
        dsn,
        env={"IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT)},
    )
    key = "slow-charge"
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(send(session, f"{proxy.url}/charges?delay=1", key=key))
        await _until_in_flight(dsn)
        assert not request.done()
        signalled = time.monotonic()
        code = await proxy.terminate(timeout=SHUTDOWN_TIMEOUT + 5, signum=signum)
        stopped = time.monotonic() - signalled
        answer = await request

    assert code == 0, proxy.describe()
    assert stopped < SHUTDOWN_TIMEOUT, f"exit took {stopped:.1f}s"
    assert answer.status == 201, proxy.describe()
    assert b'"execution": 1' in answer.body
    assert backend.ledger.count(key) == 1

    job = await _only_job(dsn)
    assert (job.key, job.state) == (key, JobState.COMPLETED)
    assert job.id == answer.job
    assert [(a.number, a.state, a.status) for a in job.attempts] == [
        (1, AttemptState.SUCCEEDED, 201)
    ]


async def _until_in_flight(dsn: str, deadline: float = 5.0) -> None:
    """The claim is committed before a byte goes upstream (SPEC §2.2): wait for it to show."""
    async with _opened(dsn) as store:
        until = time.monotonic() + deadline
        while not await store.list_jobs(state=JobState.IN_FLIGHT):
            assert time.monotonic() < until, "the request never reached the proxy"
            await asyncio.sleep(0.02)


async def _only_job(dsn: str) -> Job:
    async with _opened(dsn) as store:
        jobs = await store.list_jobs()
        assert len(jobs) == 1, jobs
        job = await store.get_by_id(jobs[0].id)
    assert job is not None
    return job


class _opened:
    def __init__(self, dsn: str) -> None:
        self._store: Store = create_store(dsn)

    async def __aenter__(self) -> Store:
        await self._store.open()
        return self._store

    async def __aexit__(self, *_exc: object) -> None:
        await self._store.close()


async def test_a_stop_signal_as_the_listener_opens_drains_rather_than_kills(
    tmp_path: Path, backend: Backend
) -> None:
    """SPEC §8: the stop signals are the drain's from the moment the proxy listens. Sent the
    instant a connection is accepted (before the admin listener is up), SIGTERM used to take
    its default action: the process died of it (-15), a request already read got a reset."""
    for attempt in range(3):
        proxy = _early_proxy(tmp_path, backend, f"early-stop-{attempt}")
        try:
            _connectable(proxy).close()
            os.kill(proxy.pid, signal.SIGTERM)
            code = await proxy.wait_exit(STOP_DEADLINE)
            assert code == 0, proxy.describe()
        finally:
            proxy.kill()


@pytest.mark.parametrize("method", ["POST", "PUT"])  # governed, and passed through
async def test_a_request_sent_as_the_listener_opens_is_answered_or_never_run(
    tmp_path: Path, backend: Backend, method: str
) -> None:
    """SPEC §8: whatever the moment of SIGTERM, a request the upstream ran is answered. Sent
    on a connection accepted in the instant before the drain, it was read after the drain had
    found nothing to wait for, ran upstream, and lost its answer to the connection's close."""
    for attempt in range(8):  # the moment is a race: each try catches it now and then
        key = f"early-{method}-{attempt}"
        proxy = _early_proxy(tmp_path, backend, f"early-request-{method}-{attempt}")
        try:
            sock = _connectable(proxy)
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(
                f"{method} /charges?delay=0.3 HTTP/1.1\r\nHost: p\r\nIdempotency-Key: {key}\r\n"
                "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}".encode()
            )
            await writer.drain()
            os.kill(proxy.pid, signal.SIGTERM)
            try:
                answer = await asyncio.wait_for(reader.read(), STOP_DEADLINE)
            except ConnectionResetError:  # closed with the request unread: never run
                answer = b""
            writer.close()
            assert await proxy.wait_exit(STOP_DEADLINE) == 0, proxy.describe()
        finally:
            proxy.kill()
        if key in backend.ledger.arrivals:
            assert answer.startswith(b"HTTP/1.1 "), (answer, proxy.describe())


def _early_proxy(tmp_path: Path, backend: Backend, name: str) -> ProxyProcess:
    port = free_port()
    listen = ["--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{free_port()}"]
    store = ["--store", f"sqlite:///{tmp_path}/{name}.db"]
    proxy = ProxyProcess(
        name, [*listen, "--upstream", backend.url, *store], port, 0, tmp_path, tmp_path
    )
    proxy.spawn(child_env({"IDEMPROXY_OWNER__STRATEGY": "none"}))
    return proxy


def _connectable(proxy: ProxyProcess) -> socket.socket:
    """A connection, as soon as the port takes one (a blocking connect, tried every
    millisecond)."""
    until = time.monotonic() + START_DEADLINE
    while True:
        assert proxy.returncode is None, proxy.describe()
        assert time.monotonic() < until, proxy.describe()
        sock = socket.socket()
        if sock.connect_ex(("127.0.0.1", proxy.port)) == 0:
            sock.setblocking(False)
            return sock
        sock.close()
        time.sleep(0.001)
