"""Real server processes on free loopback ports: the servers of the fidelity suite and the
`idemproxy serve` processes in front of them.

A server is started with its port in its command line, and is ready when the port accepts a
connection; one that dies first (a port lost to another process: it is tried again on another)
fails with what it printed. Teardown sends SIGTERM, then SIGKILL, and always reaps.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.ports import free_port
from tests.support.processes import child_env

START_DEADLINE = 30.0  # seconds: an interpreter, a framework and its app importing
STOP_DEADLINE = 10.0
_PORT_LOST = ("address already in use", "eaddrinuse", "errno 98")
ROOT = Path(__file__).resolve().parents[2]  # the repository: app modules import from it


@dataclass
class Running:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _wait_ready(running: Running) -> None:
    until = time.monotonic() + START_DEADLINE
    while True:
        if running.process.poll() is not None:
            raise _Died(running)
        try:
            socket.create_connection(("127.0.0.1", running.port), timeout=1).close()
        except OSError:
            if time.monotonic() > until:
                _stop(running)
                raise AssertionError(f"{running.name} not ready: {running.output()}") from None
            time.sleep(0.05)
        else:
            return


class _Died(Exception):
    def __init__(self, running: Running) -> None:
        super().__init__(f"{running.name} exited {running.process.returncode}: {running.output()}")
        self.port_lost = any(s in running.output().lower() for s in _PORT_LOST)


def _stop(running: Running) -> None:
    if running.process.poll() is None:
        running.process.send_signal(signal.SIGTERM)
        try:
            running.process.wait(timeout=STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            running.process.kill()
    running.process.wait(timeout=STOP_DEADLINE)


@contextlib.contextmanager
def serving(
    name: str,
    command: Callable[[int], Sequence[str]],
    logs: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
) -> Iterator[Running]:
    """`command(port)` running on a free port until the block ends."""
    for _try in range(3):
        port = free_port()
        log = logs / f"{name}-{port}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                list(command(port)),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=child_env(env),
            )
        running = Running(name, port, process, log)
        try:
            _wait_ready(running)
        except _Died as died:
            if died.port_lost:
                continue
            raise AssertionError(str(died)) from None
        try:
            yield running
        finally:
            _stop(running)
        return
    raise AssertionError(f"{name}: no free port after 3 tries")


@contextlib.contextmanager
def proxy(upstream: str, store: str, logs: Path, *args: str) -> Iterator[Running]:
    """`idemproxy serve --upstream upstream --store store *args`, its admin listener on a port
    of its own, in the settings a new user starts with otherwise."""

    def command(port: int) -> list[str]:
        listen = ["--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{free_port()}"]
        return [sys.executable, "-m", "idemproxy", "serve", *listen, "--upstream", upstream,
                "--store", store, *args]  # fmt: skip

    with serving("idemproxy", command, logs, cwd=logs) as running:
        yield running


def gunicorn(app: str) -> Callable[[int, Path], list[str]]:
    """The command serving WSGI `app` (`module:callable`) with gunicorn, one sync worker (the
    app finds its ledger in the environment)."""

    def command(port: int, _ledger: Path) -> list[str]:
        return [sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", "1",
                app]  # fmt: skip

    return command
