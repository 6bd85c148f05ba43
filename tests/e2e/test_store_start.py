"""A PostgreSQL store not reachable at start is waited for (store_start), not a crash loop."""

from __future__ import annotations

import asyncio
import contextlib
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.faults.blackhole import Relay
from tests.support.client import send
from tests.support.ports import free_port

if TYPE_CHECKING:
    from .conftest import Backend, RunCli, StartProxy

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _any_holds(logs: Path, text: str) -> bool:
    return any(text in log.read_text() for log in logs.glob("*.stderr"))


async def _said(logs: Path, text: str, within: float) -> None:
    """Wait until a proxy's stderr (tests/support/processes.py's log files) holds `text`."""
    deadline = time.monotonic() + within
    while not await asyncio.to_thread(_any_holds, logs, text):
        assert time.monotonic() < deadline, f"no {text!r} in {within} s"
        await asyncio.sleep(0.05)


async def test_serve_waits_for_a_store_that_comes_up(
    pg_dsn: str, backend: Backend, start_proxy: StartProxy, tmp_path: Path
) -> None:
    parts = urlsplit(pg_dsn)
    port = free_port()
    late = parts._replace(netloc=f"{parts.username}@127.0.0.1:{port}").geturl()
    starting = asyncio.create_task(start_proxy("--upstream", backend.url, "--store", late))
    await _said(tmp_path / "logs", "trying again in", within=20)  # refused: waiting
    assert not starting.done()
    relay = Relay(parts.port or 5432)
    await relay.start(port)  # the database "comes up" on the address the proxy was given
    try:
        proxy = await starting
        assert "trying again in" in proxy.stderr(), proxy.describe()
        async with aiohttp.ClientSession() as session:
            answer = await send(session, f"{proxy.url}/payments", key="after-wait")
            assert (answer.status, answer.replayed) == (201, False), answer
            again = await send(session, f"{proxy.url}/payments", key="after-wait")
            assert (again.status, again.replayed) == (201, True), again
        assert backend.ledger.count("after-wait") == 1
    finally:
        await relay.close()


def test_serve_gives_up_after_max_wait(run_cli: RunCli) -> None:
    began = time.monotonic()
    done = run_cli(
        "serve",
        "--upstream",
        "http://127.0.0.1:9",
        "--store",
        "postgresql://nobody@127.0.0.1:9/orders",
        env={"IDEMPROXY_STORE_START__MAX_WAIT": "2", "IDEMPROXY_STORE_START__MAX_BACKOFF": "0.5"},
        timeout=20,
    )
    assert done.returncode == 1, done
    assert 2 <= time.monotonic() - began < 15
    retries = [line for line in done.stderr.splitlines() if "trying again in" in line]
    assert len(retries) >= 3, done.stderr  # 0.25, 0.5, 0.5, ... seconds apart
    assert done.stderr.splitlines()[-1] == (
        "idemproxy: cannot reach PostgreSQL at 127.0.0.1:9/orders: connection refused"
    )


@pytest.mark.parametrize(
    ("store", "said"),
    [
        ("nobody@{server}/postgres", 'role "nobody" does not exist'),
        ("postgres@{server}/idemproxy_test_no_such_database", "does not exist"),
    ],
    ids=["role", "database"],
)
def test_a_server_that_refuses_the_dsn_stops_the_start_at_once(
    pg_dsn: str, run_cli: RunCli, store: str, said: str
) -> None:
    """The server answered: no wait changes a missing role or database, and "cannot reach"
    would send the reader to the network."""
    server = urlsplit(pg_dsn).netloc.rpartition("@")[2]
    last = _refused_at_once(run_cli, "postgresql://" + store.format(server=server))
    assert "refused the connection" in last and said in last


def test_a_server_without_tls_for_a_dsn_that_requires_it_stops_the_start_at_once(
    run_cli: RunCli,
) -> None:
    """A server without ssl answers a client's TLS request `N` (PostgreSQL's protocol, "SSL
    Session Encryption"), as it will on every try: no wait changes that."""
    with _no_tls_server() as port:
        dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres?sslmode=require"
        last = _refused_at_once(run_cli, dsn)
    assert "does not take TLS" in last and "sslmode" in last


def _refused_at_once(run_cli: RunCli, store: str) -> str:
    """`serve` on `store` exits 2 well within the 30 s it would wait for an unreachable server,
    without a retry; the last line of its stderr, which names the server."""
    began = time.monotonic()
    done = run_cli(
        "serve",
        "--upstream",
        "http://127.0.0.1:9",
        "--store",
        store,
        env={"IDEMPROXY_STORE_START__MAX_WAIT": "30"},
        timeout=20,
    )
    assert done.returncode == 2, done
    assert time.monotonic() - began < 10
    last = done.stderr.splitlines()[-1]
    assert last.startswith("idemproxy: invalid configuration: store: PostgreSQL at "), last
    assert "trying again" not in done.stderr
    return last


@contextlib.contextmanager
def _no_tls_server() -> Iterator[int]:
    """A server that answers every TLS request `N`, as PostgreSQL with `ssl = off` does."""

    class NoTls(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.recv(8)  # SSLRequest: length 8, code 80877103
            self.request.sendall(b"N")

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), NoTls) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.server_address[1]
        finally:
            server.shutdown()
