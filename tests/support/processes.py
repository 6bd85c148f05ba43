"""Real `idemproxy serve` processes and the recording backend they forward to.

Each proxy is `python -m idemproxy serve …` on a free loopback port, with its stdout and stderr
captured to files under the test's `tmp_path`. Start-up waits, with a deadline, until the port
accepts connections; teardown sends SIGTERM, then SIGKILL, and always reaps the process. The
backend runs inside the test process so that its ledger can be inspected.

`start_proxy`, `start_backend` and `backend` are fixtures: a conftest imports them to use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest

from tests.support.backend import Ledger, serving
from tests.support.ports import free_port

# Seconds for a proxy to accept connections (imports + store + migrate): a bound on a hung
# start, never waited out by a proxy that starts, so generous for a loaded machine.
START_DEADLINE = 30.0
STOP_DEADLINE = 10.0  # seconds between SIGTERM and SIGKILL in teardown
_ADDRESS_IN_USE = ("address already in use", "errno 98")


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment without any `IDEMPROXY_…` variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class ProxyProcess:
    """One running `idemproxy serve` process."""

    def __init__(
        self, name: str, args: list[str], port: int, admin_port: int, logs: Path, cwd: Path
    ) -> None:
        self.name = name
        self.args = args
        self.port = port
        self.admin_port = admin_port
        self.stdout_path = logs / f"{name}.stdout"
        self.stderr_path = logs / f"{name}.stderr"
        self._cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def _popen(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None, f"{self.name} was never started"
        return self._proc

    def spawn(self, env: Mapping[str, str]) -> None:
        command = [sys.executable, "-m", "idemproxy", "serve", *self.args]
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self._proc = subprocess.Popen(
                command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=self._cwd, env=env
            )

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace") if self.stdout_path.exists() else ""

    def describe(self) -> str:
        """For assertion messages: who it is, how it ended and what it said."""
        return (
            f"{self.name} (pid {self._popen.pid}, exit {self._popen.poll()}) "
            f"args {self.args}\n--- stdout ---\n{self.stdout()[-3000:]}"
            f"\n--- stderr ---\n{self.stderr()[-3000:]}"
        )

    async def wait_ready(self, deadline: float = START_DEADLINE) -> None:
        """Until the port accepts a connection, and the admin port too (if it has one: the
        process opens it after the proxy's, and a test may call it at once); fails fast when
        the process dies first."""
        until = asyncio.get_running_loop().time() + deadline
        for port in (self.port, self.admin_port):
            if port:
                await self._wait_accepting(port, until, deadline)

    async def _wait_accepting(self, port: int, until: float, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._popen.poll() is not None:
                raise ProcessDied(self.describe())
            try:
                _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError as exc:
                if loop.time() >= until:
                    message = f"not accepting on {port} after {deadline}s: {self.describe()}"
                    raise TimeoutError(message) from exc
                await asyncio.sleep(0.05)
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return

    async def wait_exit(self, timeout: float) -> int | None:
        """The exit status, or None if it is still running after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while self._popen.poll() is None:
            if loop.time() >= until:
                return None
            await asyncio.sleep(0.02)
        return self._popen.returncode

    async def terminate(
        self, timeout: float = STOP_DEADLINE, signum: signal.Signals = signal.SIGTERM
    ) -> int:
        """`signum` (SIGTERM) and wait for the exit status; SIGKILL (and fail) if it does not
        stop."""
        if self._popen.poll() is None:
            self._popen.send_signal(signum)
        code = await self.wait_exit(timeout)
        if code is None:
            self.kill()
            raise AssertionError(f"still running {timeout}s after {signum.name}: {self.describe()}")
        return code

    def kill(self) -> None:
        """SIGKILL and reap; a no-op for a process that is gone already."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=STOP_DEADLINE)


class ProcessDied(RuntimeError):
    """A proxy exited before it accepted connections."""


class StartProxy(Protocol):
    async def __call__(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        name: str | None = None,
    ) -> ProxyProcess: ...


@pytest.fixture
async def start_proxy(tmp_path: Path) -> AsyncIterator[StartProxy]:
    """Factory: `await start_proxy("--upstream", url, "--store", dsn, env={…})`.

    `--listen 127.0.0.1:<free port>` is added (or `port`, to restart on the same one), and
    `--admin-listen` on another free port so that proxies never fight over the default.
    Every process started here is stopped (SIGTERM, then SIGKILL) at teardown.
    """
    started: list[ProxyProcess] = []
    names = itertools.count(1)
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)

    async def start(
        *args: str,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        name: str | None = None,
    ) -> ProxyProcess:
        for _try in range(3):
            listen = port or free_port()
            admin = free_port()
            proxy = ProxyProcess(
                f"{name or 'proxy'}-{next(names)}",
                ["--listen", f"127.0.0.1:{listen}", "--admin-listen", f"127.0.0.1:{admin}", *args],
                listen,
                admin,
                logs,
                tmp_path,
            )
            started.append(proxy)
            proxy.spawn(child_env(env))
            try:
                await proxy.wait_ready()
            except ProcessDied:
                lost_port_race = any(s in proxy.stderr().lower() for s in _ADDRESS_IN_USE)
                if lost_port_race:
                    continue
                raise
            return proxy
        raise AssertionError(f"no free port after 3 tries: {started[-1].describe()}")

    try:
        yield start
    finally:
        for proxy in started:
            if proxy.running:
                with contextlib.suppress(AssertionError):
                    await proxy.terminate()
            proxy.kill()


@dataclass
class Backend:
    url: str
    ledger: Ledger


StartBackend = Callable[[], Awaitable[Backend]]


@pytest.fixture
async def start_backend() -> AsyncIterator[StartBackend]:
    """Factory for recording backends (`tests/support/backend.py`) on 127.0.0.1:<ephemeral>."""
    async with contextlib.AsyncExitStack() as running:

        async def start() -> Backend:
            ledger = Ledger()
            return Backend(await running.enter_async_context(serving(ledger)), ledger)

        yield start


@pytest.fixture
async def backend(start_backend: StartBackend) -> Backend:
    return await start_backend()
