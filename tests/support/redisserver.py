"""Helpers for the Redis tests: a throwaway `redis-server`, a spying store, small waits."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from idemproxy.constants import REDIS_JOB_PREFIX
from idemproxy.store.postgres.store import PostgresStore
from tests.support.ports import free_port

# make_store(listen=True, url=None, **options) -> RedisCachedStore (over a SpyStore, `.inner`)
CachedStoreFactory = Callable[..., Awaitable[Any]]
# make_proxy(store, **settings) -> a client of the proxy app on that store
ProxyFactory = Callable[..., Awaitable[TestClient[Any, Any]]]

START_DEADLINE = 5.0
# Longer than a loaded machine stalls a test's event loop (four workers on two cores): with the
# production default of 50 ms a slow lookup counts as a miss and the store is read, which the
# tests that count store calls would take for a defect. The test of a stalled Redis sets its own.
LOOKUP_TIMEOUT = 0.5
WRITE_TIMEOUT = 2.0


class RedisServer:
    """One `redis-server` process that this test started; every signal goes to its pid only."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        argv += ["--daemonize", "no", "--loglevel", "warning"]
        with (self.workdir / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_DEADLINE
        while not self._answers():
            assert self.proc.poll() is None, f"redis-server exited: {self.log()}"
            assert time.monotonic() < deadline, f"redis-server not ready: {self.log()}"
            time.sleep(0.01)

    def stop(self) -> None:
        """SIGTERM (SIGKILL after a while) and reap: the data is gone, as after a crash."""
        if self.proc is None:
            return
        self.resume()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(START_DEADLINE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(START_DEADLINE)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers (a Redis stalled by load)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def log(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


class SpyStore(PostgresStore):
    """The real PostgreSQL store, counting every statement that reaches it by name."""

    def __init__(self, dsn: str, **kwargs: Any) -> None:
        super().__init__(dsn, **kwargs)
        self.calls: Counter[str] = Counter()

    async def _run(
        self, what: str, call: Any, observe: bool = True, *, retry: bool = True
    ) -> Any:  # one statement (its one retry counted again)
        self.calls[what] += 1
        return await super()._run(what, call, observe, retry=retry)

    @contextlib.asynccontextmanager
    async def _connection(self, what: str) -> AsyncIterator[Any]:  # several (operators' reads)
        self.calls[what] += 1
        async with super()._connection(what) as conn:
            yield conn


async def cached_entries(client: Redis) -> int:
    return len(await client.keys(f"{REDIS_JOB_PREFIX}*"))


async def wait_for(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def closed_port_url() -> str:
    """A Redis URL on a loopback port where nothing listens (connection refused)."""
    return f"redis://127.0.0.1:{free_port()}/0"
