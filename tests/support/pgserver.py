"""A throwaway PostgreSQL server of the test's own, for fault tests: real failures, not mocks.

The shared test server must never be stopped or disturbed, so tests that stop, restart, kill or
freeze PostgreSQL start one of these instead: `initdb` into a temporary directory, `postgres` on
a free loopback port, `fsync=off` (nothing here has to survive a power cut; see _SERVER_SETTINGS).

The binaries are found, never assumed: `$IDEMPROXY_PG_BINDIR`, then `pg_config --bindir`, then
the newest `/usr/lib/postgresql/*/bin` (Debian/Ubuntu), then `initdb` on `$PATH`. `initdb` and
`postgres` refuse to run as root; when the tests run as root both run as the `postgres` OS user
and the data directory is handed to that user.

Signals follow `pg_ctl`: SIGTERM is a smart shutdown, SIGINT fast, SIGQUIT immediate. Every child
of PostgreSQL puts itself in its own process group, so "the whole server" (for SIGKILL, SIGSTOP
and SIGCONT) is the postmaster plus every process whose parent it is.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import asyncpg

from tests.support.ports import free_port

START_DEADLINE = 30.0  # seconds for initdb, or for the server to accept connections
STOP_DEADLINE = 30.0  # seconds for a shutdown to finish
SUPERUSER = "postgres"
_STOP_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}
# fsync off: the tests crash PostgreSQL's processes, never the machine, and a commit written to
# the OS survives a process crash. synchronous_commit stays on: with it off, a commit reported
# to the proxy can vanish in an immediate shutdown or a SIGKILL (its WAL still in memory), and
# a retry then executes the request a second time, which is the very thing under test.
_SERVER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "full_page_writes": "off",
    "max_connections": "100",
    "shared_buffers": "32MB",
    "autovacuum": "off",
    "log_min_messages": "warning",
    "logging_collector": "off",
}


class PostgresUnavailable(RuntimeError):
    """The throwaway PostgreSQL could not be set up; the message says why."""


def find_bindir() -> Path:
    """The directory holding `initdb` and `postgres` (see the module docstring)."""
    candidates: list[Path] = []
    if env := os.environ.get("IDEMPROXY_PG_BINDIR"):
        candidates.append(Path(env))
    if pg_config := shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            )
            candidates.append(Path(out.stdout.strip()))
    candidates.extend(sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version, reverse=True))
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).parent)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    raise PostgresUnavailable(
        f"no PostgreSQL server binaries (initdb, postgres) in {[str(c) for c in candidates]}; "
        "install them or set IDEMPROXY_PG_BINDIR"
    )


def _version(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name)) or (0,)


class ThrowawayPostgres:
    """One private PostgreSQL server: `start()`, break it in various ways, `destroy()`."""

    def __init__(
        self,
        root: Path | None = None,
        *,
        port: int | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.bindir = find_bindir()
        self._settings = {**_SERVER_SETTINGS, **(settings or {})}
        self.root = Path(root or tempfile.mkdtemp(prefix="idemproxy-pg-"))
        self.data = self.root / "data"
        self.log_path = self.root / "postgres.log"
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._as_root = os.geteuid() == 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """initdb on first use, then run the server until it accepts connections."""
        if self.running:
            return
        if not (self.data / "PG_VERSION").exists():
            self._initdb()
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self._command(
                    "postgres", "-D", str(self.data), "-p", str(self.port), *self._flags()
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                **self._as_postgres(),
            )
        self._wait_accepting()

    def stop(self, mode: str = "fast") -> None:
        """Shut down `smart`, `fast` (clients disconnected) or `immediate` (no checkpoint; the
        next start runs crash recovery). A stopped or frozen-then-killed server is fine too."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._proc = None
            return
        self.resume()  # a frozen server cannot shut down
        proc.send_signal(_STOP_SIGNALS[mode])
        try:
            proc.wait(timeout=STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise PostgresUnavailable(f"{mode} shutdown took over {STOP_DEADLINE}s") from None
        self._proc = None  # the postmaster exits only after every child did

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def kill9(self) -> None:
        """SIGKILL the postmaster and every backend at once: the machine "lost power"."""
        killed = self._signal_all(signal.SIGKILL)
        if self._proc is not None:
            self._proc.wait(timeout=STOP_DEADLINE)
            self._proc = None
        _wait_gone(killed)

    def pause(self) -> None:
        """SIGSTOP the whole server: connections stay open and nothing answers (a stall)."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`; harmless on a server that runs."""
        self._signal_all(signal.SIGCONT)

    def destroy(self) -> None:
        """Stop the server (immediately) and delete its directory."""
        with contextlib.suppress(PostgresUnavailable):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    # -- facts -------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The postmaster's process id."""
        if self._proc is None:
            raise PostgresUnavailable("the server is not running")
        return self._proc.pid

    def child_pids(self) -> list[int]:
        """Every process whose parent is the postmaster (backends and auxiliaries)."""
        if self._proc is None:
            return []
        return _children_of(self._proc.pid)

    def dsn(self, database: str = "postgres", *, port: int | None = None, **params: str) -> str:
        """A DSN for `database`; `port` to go through a relay instead; `params` for the query."""
        query = "&".join(f"{name}={value}" for name, value in params.items())
        return f"postgresql://{SUPERUSER}@127.0.0.1:{port or self.port}/{database}" + (
            f"?{query}" if query else ""
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- SQL helpers (each on a connection of its own to the `postgres` database) ------------

    async def execute(self, sql: str, *args: Any, timeout: float = 10.0) -> str:
        conn = await asyncpg.connect(self.dsn(), timeout=timeout)
        try:
            return await conn.execute(sql, *args, timeout=timeout)
        finally:
            await conn.close(timeout=timeout)

    async def fetch(self, sql: str, *args: Any, timeout: float = 10.0) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn(), timeout=timeout)
        try:
            return await conn.fetch(sql, *args, timeout=timeout)
        finally:
            await conn.close(timeout=timeout)

    async def backends(self, database: str) -> list[asyncpg.Record]:
        """The client connections to `database` (pid, application_name, state, wait, query)."""
        return await self.fetch(
            "SELECT pid, application_name, state, wait_event_type, query"
            " FROM pg_stat_activity"
            " WHERE datname = $1 AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
            database,
        )

    async def terminate_backends(
        self,
        database: str | None = None,
        *,
        application_name: str | None = None,
        pids: Sequence[int] | None = None,
    ) -> list[int]:
        """`pg_terminate_backend` on every client connection that matches all the filters given
        (never this helper's own); the pids that were terminated."""
        # In the select list, not the WHERE clause: PostgreSQL may evaluate WHERE conditions in
        # any order, and would then terminate backends the filters were meant to spare.
        rows = await self.fetch(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
            "   AND ($1::text IS NULL OR datname = $1)"
            "   AND ($2::text IS NULL OR application_name = $2)"
            "   AND ($3::int[] IS NULL OR pid = ANY($3))",
            database,
            application_name,
            list(pids) if pids is not None else None,
        )
        return [row["pid"] for row in rows]

    # -- internals ---------------------------------------------------------------------------

    def _initdb(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self._as_root:
            shutil.chown(self.root, SUPERUSER, SUPERUSER)
            self.root.chmod(0o700)
        done = subprocess.run(
            self._command(
                "initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust",
                "--encoding=UTF8", "--no-sync", "--no-instructions",
            ),
            capture_output=True,
            stdin=subprocess.DEVNULL,
            cwd=self.root,
            timeout=START_DEADLINE,
            check=False,
            **self._as_postgres(),
        )  # fmt: skip
        if done.returncode != 0:
            raise PostgresUnavailable(
                f"initdb failed ({done.returncode}):\n{done.stdout.decode(errors='replace')}"
                f"\n{done.stderr.decode(errors='replace')}"
            )

    def _flags(self) -> list[str]:
        settings = {**self._settings, "unix_socket_directories": str(self.root)}
        return [arg for name, value in settings.items() for arg in ("-c", f"{name}={value}")]

    def _command(self, program: str, *args: str) -> list[str]:
        return [str(self.bindir / program), *args]

    def _as_postgres(self) -> dict[str, Any]:
        """Popen arguments that drop root for the `postgres` OS user (initdb refuses root)."""
        if not self._as_root:
            return {}
        return {"user": SUPERUSER, "group": SUPERUSER, "extra_groups": []}

    def _wait_accepting(self) -> None:
        """Until `pg_isready` says so (no event loop needed: callable from any context)."""
        until = time.monotonic() + START_DEADLINE
        probe = self._command("pg_isready", "-q", "-h", "127.0.0.1", "-p", str(self.port))
        while True:
            if self._proc is None or self._proc.poll() is not None:
                raise PostgresUnavailable(f"postgres exited at start:\n{self.log()[-3000:]}")
            if subprocess.run(probe, check=False, timeout=START_DEADLINE).returncode == 0:
                return
            if time.monotonic() >= until:
                raise PostgresUnavailable(
                    f"not accepting after {START_DEADLINE}s:\n{self.log()[-3000:]}"
                )
            time.sleep(0.05)

    def _signal_all(self, signum: signal.Signals) -> list[int]:
        """Signal the postmaster and its children; the pids signalled."""
        if self._proc is None or self._proc.poll() is not None:
            return []
        pids = [self._proc.pid, *self.child_pids()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return pids


def _wait_gone(pids: Sequence[int]) -> None:
    """Backends outliving their postmaster would keep the next start from running."""
    until = time.monotonic() + STOP_DEADLINE
    while any(_alive(pid) for pid in pids):
        if time.monotonic() >= until:
            raise PostgresUnavailable(f"processes {list(pids)} outlived SIGKILL")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie holds no memory and no socket


def _children_of(parent: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name may hold spaces and parentheses: split after the last ')'.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                children.append(int(stat.parent.name))
    return children
