"""What every part of the benchmark shares: its processes, CPU accounting, PostgreSQL and wrk.

Used by the run (harness.py, runner.py, scenarios/), by bench/compare (instructions.py) and by
response_memory.py. Every process it starts listens on a free loopback port, runs in a session
of its own and is stopped by whoever started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# The only databases bench/run creates, uses and drops.
BENCH_DB = "idemproxy_bench"  # the proxies' store
PGBENCH_DB = "idemproxy_bench_pg"  # pgbench's claim + complete
BIG_DB = "idemproxy_bench_big"  # --big-store
BASE_DB = "idemproxy_bench_base"  # --baseline: the previous design's store
BODY = '{"amount":1250,"currency":"EUR","note":"bench"}'
PATH = "/orders"
READY_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0
TICKS = os.sysconf("SC_CLK_TCK")


# --- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    """One child process we started; `stop()` ends exactly that process."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int,
        log_dir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.admin_url: str | None = None  # idemproxy's admin listener
        self.log = log_dir / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # a Ctrl-C reaches only us; we stop it ourselves
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pids(self) -> list[int]:
        """The process and its children (nginx's workers, idemproxy's with --workers)."""
        return [self.pid, *children(self.pid)]

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until GET / answers 200 (through a proxy that means the backend answered too)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}: see {self.log}"
                )
            with contextlib.suppress(OSError):
                status, _, _ = http_request(self.port, "GET", "/")
                if status == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s: see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()  # all of them shut down cleanly on SIGTERM (nginx: fast shutdown)
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT)


class RedisService(Service):
    """A throwaway redis-server of our own (no persistence): the cache, or the peer's store."""

    def __init__(self, name: str, binary: str, port: int, log_dir: Path) -> None:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(log_dir)]
        super().__init__(name, argv, port, log_dir)
        self.url = f"redis://127.0.0.1:{port}/0"

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis exited with {self.proc.returncode}: see {self.log}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"redis not ready after {timeout:.0f}s: see {self.log}")


@contextlib.contextmanager
def running(service: Service) -> Iterator[Service]:
    try:
        service.wait_ready()
        yield service
    finally:
        service.stop()


def wait_all_workers(proxy: Service) -> None:
    """GET / through the port proves one worker; /readyz on the admin listener proves all."""
    assert proxy.admin_url is not None
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, http.client.HTTPException):
            status, _, _ = http_request(_port(proxy.admin_url), "GET", "/readyz")
            if status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{proxy.name}: not every worker ready: see {proxy.log}")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text()
            found += [int(child) for child in text.split()]
    return found


def http_request(
    port: int, method: str, path: str, headers: dict[str, str] | None = None, body: str = ""
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body.encode() or None, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def counts(counter: Service, prefix: str | None = None) -> dict[str, int]:
    """The backend's (or the peer's) POST counts; with `prefix`, of the keys starting with it."""
    path = "/_stats" if prefix is None else f"/_stats?prefix={prefix}"
    status, _, body = http_request(counter.port, "GET", path)
    if status != 200:
        raise RuntimeError(f"{counter.name} /_stats answered {status}")
    parsed: dict[str, int] = json.loads(body)
    return parsed


def settled_counts(
    counter: Service, prefix: str | None = None, quiet: float = 0.3, limit: float = 10.0
) -> dict[str, int]:
    """The POST counts once they stop changing.

    wrk hangs up at the end of a run with requests in flight, and the proxy still finishes their
    attempts (a client hanging up cancels nothing); waiting counts them in the run they belong to.
    """
    deadline = time.monotonic() + limit
    last = counts(counter, prefix)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = counts(counter, prefix)
        if now == last:
            break
        last = now
    return last


# --- CPU accounting (Linux /proc) -------------------------------------------------------------


def machine_ticks() -> tuple[int, int]:
    """(busy, irq + softirq) jiffies of all CPUs since boot; busy includes hypervisor steal."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq + steal, irq + softirq


def process_ticks(pid: int, user: bool = True) -> int:
    """utime + stime of a process (stime alone with user=False)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) if user else 0) + int(fields[12])


def children_ticks() -> float:
    usage = os.times()
    return (usage.children_user + usage.children_system) * TICKS


def background_busy(seconds: float = 2.0) -> float:
    """The machine's busy CPU over `seconds`, in % of one core."""
    busy0, _ = machine_ticks()
    time.sleep(seconds)
    busy1, _ = machine_ticks()
    return 100.0 * (busy1 - busy0) / TICKS / seconds


def pg_backend_pids(database: str) -> set[int]:
    """PostgreSQL's server processes connected to `database` (by their process title)."""
    needle = f" {database} ".encode()
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            title = (entry / "cmdline").read_bytes()
            if title.startswith(b"postgres: ") and needle in title:
                found.add(int(entry.name))
    return found


class PgTicks:
    """CPU of the server processes of one database over a run, including connections that come
    and go during it (pgbench's): sampled five times a second from a thread."""

    def __init__(self, database: str | None) -> None:
        self.database = database
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, initial: bool) -> None:
        if self.database is None:
            return
        for pid in pg_backend_pids(self.database):
            ticks = process_ticks(pid)
            if pid not in self.first:
                self.first[pid] = ticks if initial else 0
            self.last[pid] = max(self.last.get(pid, 0), ticks)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample(initial=False)

    def __enter__(self) -> PgTicks:
        self._sample(initial=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(initial=False)

    @property
    def ticks(self) -> int:
        return sum(self.last[pid] - self.first[pid] for pid in self.first)


# --- PostgreSQL (only the benchmark's own databases) -------------------------------------------


def pg_dsn(admin_dsn: str, database: str) -> str:
    base, _, _ = admin_dsn.rpartition("/")
    return f"{base}/{database}"


async def _pg(
    admin_dsn: str, query: str, *args: Any, database: str, session: Sequence[str]
) -> list[Any]:
    conn = await asyncpg.connect(pg_dsn(admin_dsn, database), timeout=10)
    try:
        for statement in session:
            await conn.execute(statement)
        return list(await conn.fetch(query, *args, timeout=3600))
    finally:
        await conn.close()


def pg(
    admin_dsn: str,
    query: str,
    *args: Any,
    database: str = BENCH_DB,
    session: Sequence[str] = (),
) -> list[Any]:
    """One query on its own connection, after the `session` statements (SET …)."""
    return asyncio.run(_pg(admin_dsn, query, *args, database=database, session=session))


def redacted(dsn: str) -> str:
    scheme, sep, rest = dsn.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return dsn
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{host}"


def pg_admin_db(admin_dsn: str) -> str:
    return admin_dsn.rpartition("/")[2].split("?", 1)[0] or "postgres"


def recreate_db(admin_dsn: str, database: str) -> None:
    admin = pg_admin_db(admin_dsn)
    pg(admin_dsn, f"DROP DATABASE IF EXISTS {database} WITH (FORCE)", database=admin)
    pg(admin_dsn, f"CREATE DATABASE {database}", database=admin)


def drop_db(admin_dsn: str, database: str) -> None:
    admin = pg_admin_db(admin_dsn)
    pg(admin_dsn, f"DROP DATABASE IF EXISTS {database} WITH (FORCE)", database=admin)


def pg_jobs(admin_dsn: str, prefix: str, database: str = BENCH_DB) -> int:
    rows = pg(
        admin_dsn,
        "SELECT count(*) FROM idemproxy.jobs WHERE key LIKE $1",
        prefix + "-%",
        database=database,
    )
    return int(rows[0][0])


def sqlite_jobs(path: Path, prefix: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        row = db.execute("SELECT count(*) FROM jobs WHERE key LIKE ?", (prefix + "-%",)).fetchone()
    return int(row[0])


# --- another revision of the project ------------------------------------------------------------


@contextlib.contextmanager
def worktree(revision: str, where: Path) -> Iterator[Path]:
    """The revision's files, checked out beside the working tree (which stays untouched)."""
    git = ["git", "-C", str(ROOT)]
    subprocess.run([*git, "worktree", "add", "--detach", str(where), revision], check=True)
    try:
        yield where
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(where)], check=False)


def revision_python(source: Path) -> Path:
    """A Python that runs the revision checked out at `source`: a virtualenv of its own with that
    revision installed with its own dependencies (which may differ from the working tree's),
    made on first use under build/ and kept for later runs (one per commit)."""
    commit = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    venv = ROOT / "build" / "bench-revisions" / commit[:12]
    python = venv / "bin" / "python"
    done = venv / ".installed"
    if not done.exists():
        print(f"bench: installing {commit[:12]} into {venv} (pip install)…", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, str(source)], check=True, timeout=900)
        done.write_text(commit + "\n")
    found = subprocess.run(
        [str(python), "-c", "import idemproxy; print(idemproxy.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(venv.resolve()):
        raise RuntimeError(f"the revision's idemproxy is not imported from {venv}: {found}")
    return python


# --- wrk -----------------------------------------------------------------------------------------


def serve_argv(
    port: int, admin: int, upstream: str, store: str, *extra: str, python: Path | None = None
) -> list[str]:
    """`idemproxy serve` on loopback ports, run by this Python (the project's virtualenv) or by
    `python` (another revision's, `revision_python`)."""
    return [
        str(python) if python is not None else sys.executable,
        "-m",
        "idemproxy",
        "serve",
        "--listen",
        f"127.0.0.1:{port}",
        "--upstream",
        upstream,
        "--store",
        store,
        "--admin-listen",
        f"127.0.0.1:{admin}",  # the default 127.0.0.1:9090 may be taken
        *extra,
    ]


def wrk_argv(
    wrk: str, url: str, script: str, threads: int, connections: int, seconds: float, *args: str
) -> list[str]:
    argv = [wrk, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s"]
    argv += ["--timeout", "10s", "-s", str(BENCH / script), url]
    if args:
        argv += ["--", *args]
    return argv


WRK_ENV = {**os.environ, "BENCH_BODY": BODY, "BENCH_PATH": PATH}


def run_wrk(
    wrk: str, url: str, script: str, threads: int, connections: int, seconds: float, *args: str
) -> dict[str, Any]:
    argv = wrk_argv(wrk, url, script, threads, connections, seconds, *args)
    out = subprocess.run(
        argv, capture_output=True, text=True, env=WRK_ENV, timeout=seconds + 60, check=False
    )
    for line in out.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            parsed: dict[str, Any] = json.loads(line.removeprefix("BENCH_RESULT "))
            return parsed
    raise RuntimeError(f"wrk gave no result (exit {out.returncode}):\n{out.stdout}\n{out.stderr}")
