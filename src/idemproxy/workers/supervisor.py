"""`idemproxy serve` with `server.workers` > 1: a supervisor of N worker processes.

The proxy is CPU-bound in one event loop; workers are how one host uses more cores. The
supervisor applies migrations once, then re-runs the same serve command line N times with a
hidden `--worker-role` (workers/role.py) and `--no-migrate`. Every worker binds `listen` with
SO_REUSEPORT, so the kernel spreads connections over them; they share nothing but the
PostgreSQL store, exactly like replicas (held duplicates are woken by LISTEN/NOTIFY).

Worker 0 serves the configured admin address and answers /readyz and /metrics for all workers
(admin/peers.py); worker i > 0 serves its admin app on a loopback socket bound here and
inherited, so worker 0 knows every address before anything starts and no port can be lost to
a race.

A port something else listens on, a single process or another group (SO_REUSEPORT would let
its workers join), is refused before anything starts (workers/listen.py).

Signals: SIGTERM, SIGINT or SIGHUP is forwarded to every worker, which drains as a single process
does (`server.shutdown_timeout`); the supervisor exits 0 when all of them exit cleanly. A worker
that exits on its own is a failure: the others are stopped the same way and the supervisor exits 1,
for the process manager (systemd, Kubernetes) to restart the whole set. Restarting one worker in
place was not chosen: a crash loop would then hide behind a supervisor that looks healthy. Workers
still running `shutdown_timeout` + `pool.store_timeout` + `_KILL_MARGIN_SECONDS` after the stop are
killed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from idemproxy.config.settings import Settings, log_settings_warnings
from idemproxy.identity.intent import log_owner_hint
from idemproxy.observe.logs import configure_logging
from idemproxy.store.factory import command_store
from idemproxy.workers.listen import claim_listen
from idemproxy.workers.role import STOP_SIGNALS, WORKER_ROLE_FLAG, WorkerRole

log = logging.getLogger("idemproxy.supervisor")

_POLL_SECONDS = 0.05
# Beyond shutdown_timeout: a worker's drain lets cut-off attempts settle (5 s), then closes.
_KILL_MARGIN_SECONDS = 15.0
# A worker stopped before its loop installed handlers dies of the signal itself (or raises
# KeyboardInterrupt, 130): as clean as a drained exit, since it was not serving yet.
_CLEAN_EXITS = frozenset({0, 130, *(-signum for signum in STOP_SIGNALS)})
_ADMIN_BACKLOG = 64


@dataclass(slots=True)
class _Worker:
    index: int
    process: subprocess.Popen[bytes]
    exit_code: int | None = None

    def send(self, signum: int) -> None:
        # Never reaped outside `poll()` in the main loop, so the pid cannot have been reused.
        if self.exit_code is None and self.process.returncode is None:
            self.process.send_signal(signum)


def supervise(settings: Settings, serve_argv: Sequence[str]) -> int:
    """Run `settings.server.workers` workers of `idemproxy <serve_argv>`; the exit status."""
    configure_logging(settings.log_level, settings.log_format)
    log_settings_warnings(settings)
    log_owner_hint(settings.owner)
    # A taken port fails here, as it does for a single process (workers/listen.py).
    lock = claim_listen(settings.listen)
    try:
        if settings.migrate:
            asyncio.run(_migrate(settings.store))
        return _Supervisor(settings, serve_argv, lock).run()
    finally:
        if lock is not None:
            lock.close()


async def _migrate(dsn: str) -> None:
    store = command_store(dsn)
    await store.open()
    try:
        applied = await store.migrate()
    finally:
        await store.close()
    if applied:
        log.info("applied %d migration(s): %s", len(applied), ", ".join(applied))


class _Supervisor:
    def __init__(
        self, settings: Settings, serve_argv: Sequence[str], lock: socket.socket | None
    ) -> None:
        self._lock = lock  # the listen address's, until the workers stop (workers/listen.py)
        self._count = settings.server.workers
        # Then the follow-ups a worker still holds get pool.store_timeout (proxy/app.py).
        self._shutdown_timeout = settings.server.shutdown_timeout + settings.pool.store_timeout
        self._argv = list(serve_argv)
        self._workers: list[_Worker] = []
        self._signal: int | None = None  # received, not yet forwarded
        self._stopping = False
        self._failed = False
        self._kill_at: float | None = None

    def run(self) -> int:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        try:
            self._start_workers()
            self._watch()
        finally:
            self._kill_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return 1 if self._failed else 0

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only recorded: forwarding (and reaping) happens in the main loop, one place.
        self._signal = signum

    def _start_workers(self) -> None:
        sockets = [_admin_socket() for _ in range(1, self._count)]
        try:
            peers = tuple(_url(sock) for sock in sockets)
            roles = [WorkerRole(0, self._count, peers=peers)] + [
                WorkerRole(i, self._count, admin_fd=sock.fileno())
                for i, sock in enumerate(sockets, start=1)
            ]
            for role in roles:
                if self._signal is not None:
                    break
                self._workers.append(_Worker(role.index, self._spawn(role)))
            log.info(
                "supervisor started %d workers: pids %s",
                len(self._workers),
                ", ".join(str(w.process.pid) for w in self._workers),
            )
        finally:
            for sock in sockets:
                sock.close()  # the workers hold their own copies

    def _spawn(self, role: WorkerRole) -> subprocess.Popen[bytes]:
        command = [
            sys.executable,
            "-m",
            "idemproxy",
            *self._argv,
            "--no-migrate",
            WORKER_ROLE_FLAG,
            role.to_arg(),
        ]
        fds = () if role.admin_fd is None else (role.admin_fd,)
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=fds)

    def _watch(self) -> None:
        while any(w.exit_code is None for w in self._workers):
            if self._signal is not None:
                signum, self._signal = self._signal, None
                log.info("supervisor: %s, stopping the workers", signal.Signals(signum).name)
                self._stop(signum)
            for worker in self._workers:
                if worker.exit_code is None and (code := worker.process.poll()) is not None:
                    worker.exit_code = code
                    self._exited(worker, code)
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                log.error("supervisor: workers still running past the drain deadline: killing")
                self._failed = True
                self._kill_all()
            time.sleep(_POLL_SECONDS)

    def _exited(self, worker: _Worker, code: int) -> None:
        pid = worker.process.pid
        if not self._stopping:
            log.error(
                "worker %d (pid %d) exited unexpectedly with status %d: stopping the others",
                worker.index,
                pid,
                code,
            )
            self._failed = True
            self._stop(signal.SIGTERM)
        elif code not in _CLEAN_EXITS:
            log.error("worker %d (pid %d) exited with status %d", worker.index, pid, code)
            self._failed = True
        else:
            log.info("worker %d (pid %d) stopped", worker.index, pid)

    def _stop(self, signum: int) -> None:
        if not self._stopping:
            self._stopping = True
            self._kill_at = time.monotonic() + self._shutdown_timeout + _KILL_MARGIN_SECONDS
            if self._lock is not None:
                # The workers stop listening at once: a group replacing this one may start.
                self._lock.close()
        for worker in self._workers:
            worker.send(signum)

    def _kill_all(self) -> None:
        for worker in self._workers:
            worker.send(signal.SIGKILL)
        for worker in self._workers:
            if worker.exit_code is None:
                worker.exit_code = worker.process.wait()


def _admin_socket() -> socket.socket:
    """A listening loopback socket on an ephemeral port, for one worker's admin app."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(_ADMIN_BACKLOG)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"
