"""The benchmark: the backend direct, nginx, idemproxy and the peer, in one run (bench/README.md).

Starts the backend, nginx, the proxies, the peer and their stores on free loopback ports, drives
them with wrk (and pgbench, and an asyncio client for the memory tests), stops everything it
started (also on failure or Ctrl-C), writes docs/benchmarks.md and docs/benchmarks.png and
prints the results. Run it through `bench/run`, which picks the project's virtualenv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import platform
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

import asyncpg

import memory
import nginx
import pgbench_claim
import profiling
import report
import tools
from model import (
    CONCURRENCY,
    SCENARIOS,
    WORKER_SCENARIOS,
    WORKERS,
    CpuUse,
    Result,
    Scenario,
)

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# The only databases this script creates, uses and drops.
BENCH_DB = "idemproxy_bench"  # the proxies' store
PGBENCH_DB = "idemproxy_bench_pg"  # pgbench's claim + complete
BIG_DB = "idemproxy_bench_big"  # --big-store
BODY = '{"amount":1250,"currency":"EUR","note":"bench"}'
PATH = "/orders"
READY_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0
TICKS = os.sysconf("SC_CLK_TCK")
HOT_KEYS = 8  # the hot-key storm: keys in use at once …
HOT_ROUNDS = 32  # … each replaced after this many requests for it per wrk thread
# The in-process replay cache off (`replay_cache.max_bytes: 0`): replays are read from the store.
NO_REPLAY_CACHE = {"IDEMPROXY_REPLAY_CACHE__MAX_BYTES": "0"}
PROFILED = ("passthrough", "new-pg", "replay-pg")  # py-spy runs, at saturation
SWEEP_RATE = 1000  # --sweeper: jobs expiring per second


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


# --- wrk -----------------------------------------------------------------------------------------


def serve_argv(port: int, admin: int, upstream: str, store: str, *extra: str) -> list[str]:
    """`idemproxy serve` on loopback ports, run by this Python (the project's virtualenv)."""
    return [
        sys.executable,
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


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    tools: dict[str, str]
    bench_python: Path
    run_dir: Path
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    services: dict[str, Service] = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    memory_results: list[memory.MemoryResult] = field(default_factory=list)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # big store, sweeper: their own facts
    replay_prefix: str = ""
    replay_count: int = 0
    variant: str = ""  # set while measuring a variant (big store, sweeper)
    io_probe: Callable[[str], None] | None = None  # called with "start"/"stop" around a run
    database: str = BENCH_DB  # the proxies' current store database

    @property
    def wrk(self) -> str:
        return self.tools["wrk"]

    @property
    def sqlite_path(self) -> Path:
        return self.run_dir / "sqlite-store.db"

    def wanted(self, name: str) -> bool:
        return not self.args.only or name in self.args.only

    # -- starting things

    def start_backend(self) -> Service:
        port = free_port()
        argv = [sys.executable, str(BENCH / "backend.py"), "--listen", f"127.0.0.1:{port}"]
        service = Service("backend", argv, port, self.run_dir)
        self.services["backend"] = service
        return service

    def start_proxy(
        self, target: str, store: str, *extra: str, env: dict[str, str] | None = None
    ) -> Service:
        port, admin = free_port(), free_port()
        argv = serve_argv(port, admin, self.services["backend"].url, store, *extra)
        service = Service(target, argv, port, self.run_dir, env)
        service.admin_url = f"http://127.0.0.1:{admin}"
        self.services[target] = service
        return service

    def start_redis(self, name: str) -> RedisService:
        redis = RedisService(name, self.tools["redis-server"], free_port(), self.run_dir)
        self.services[name] = redis
        return redis

    def pg_store(self) -> str:
        return pg_dsn(self.args.pg_dsn, self.database)

    # -- the whole run

    def run_all(self) -> None:
        with running(self.start_backend()):
            self.measure(SCENARIOS["direct"])
            if self.wanted("nginx"):
                self.run_nginx()
            names = ("passthrough", "new-pg", "replay-pg", "hot-pg", "profiles")
            if any(self.wanted(n) for n in names):
                self.run_proxy_pg()
            if self.wanted("replay-pg-store"):
                self.run_proxy_pg_store()
            if any(self.wanted(n) for n in WORKER_SCENARIOS):
                self.run_proxy_pg_workers()
            if self.wanted("new-sqlite"):
                with running(self.start_proxy("proxy-sqlite", f"sqlite:///{self.sqlite_path}")):
                    self.measure(SCENARIOS["new-sqlite"])
            if self.wanted("new-pg-redis") or self.wanted("replay-pg-redis"):
                self.run_redis()
            if any(self.wanted(n) for n in ("peer-plain", "peer-new", "peer-replay")):
                self.run_peer()
            if self.wanted("pgbench"):
                self.run_pgbench()
            if self.wanted("memory"):
                self.run_memory()
            if self.args.sweeper:
                self.run_sweeper()
            if self.args.big_store:
                self.run_big_store()
        order = list(SCENARIOS)
        variants = ["", "sweeper-idle", "sweeper-busy", "big-store-empty", "big-store"]
        self.results.sort(
            key=lambda r: (variants.index(r.variant), order.index(r.scenario), r.connections)
        )

    def run_nginx(self) -> None:
        prefix = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
        prefix.chmod(0o755)
        try:
            port = free_port()
            conf = nginx.write_config(prefix, port, self.services["backend"].port)
            argv = nginx.argv(self.tools["nginx"], prefix, conf)
            service = Service("nginx", argv, port, self.run_dir)
            self.services["nginx"] = service
            with running(service):
                self.measure(SCENARIOS["nginx"])
            with contextlib.suppress(OSError):
                (self.run_dir / "nginx.conf").write_text(conf.read_text())
                (self.run_dir / "nginx-error.log").write_text((prefix / "error.log").read_text())
        finally:
            for path in sorted(prefix.rglob("*"), reverse=True):
                with contextlib.suppress(OSError):
                    path.rmdir() if path.is_dir() else path.unlink()
            with contextlib.suppress(OSError):
                prefix.rmdir()

    def run_proxy_pg(self) -> None:
        with running(self.start_proxy("proxy-pg", self.pg_store())) as proxy:
            for name in ("passthrough", "new-pg"):
                if self.wanted(name):
                    self.measure(SCENARIOS[name])
            if self.wanted("replay-pg") or self.wanted("profiles"):
                self.prewarm_replays(proxy)
            if self.wanted("replay-pg"):
                self.measure(SCENARIOS["replay-pg"])
            if self.wanted("hot-pg"):
                self.measure(SCENARIOS["hot-pg"])
            if self.wanted("profiles"):
                for name in PROFILED:
                    self.profile(SCENARIOS[name], proxy)

    def run_proxy_pg_store(self) -> None:
        """Replays read from PostgreSQL: the same store, the in-process replay cache off."""
        proxy = self.start_proxy("proxy-pg-store", self.pg_store(), env=NO_REPLAY_CACHE)
        with running(proxy):
            self.prewarm_replays(proxy, "replay-store")
            self.measure(SCENARIOS["replay-pg-store"])

    def run_proxy_pg_workers(self) -> None:
        """The same store and scenarios with `--workers 2`: two processes on one port."""
        proxy = self.start_proxy("proxy-pg-w2", self.pg_store(), "--workers", str(WORKERS))
        with running(proxy):
            wait_all_workers(proxy)
            for name in ("passthrough-w2", "new-pg-w2"):
                if self.wanted(name):
                    self.measure(SCENARIOS[name])
            if self.wanted("replay-pg-w2"):
                self.prewarm_replays(proxy, "replay-w2")
                self.measure(SCENARIOS["replay-pg-w2"])

    def run_redis(self) -> None:
        """The same PostgreSQL store with the Redis replay cache in front (`--redis`)."""
        redis = self.start_redis("redis")
        with (
            running(redis),
            running(
                self.start_proxy(
                    "proxy-pg-redis", self.pg_store(), "--redis", redis.url, env=NO_REPLAY_CACHE
                )
            ),
        ):
            if self.wanted("new-pg-redis"):
                self.measure(SCENARIOS["new-pg-redis"])
            if self.wanted("replay-pg-redis"):
                self.prewarm_replays(self.services["proxy-pg-redis"], "replay-redis")
                self.measure(SCENARIOS["replay-pg-redis"])

    def run_peer(self) -> None:
        """The peer: the backend's POST in a Starlette app behind asgi-idempotency-header."""
        redis = self.start_redis("redis-peer")
        port = free_port()
        argv = [str(self.bench_python), str(BENCH / "peer_app.py")]
        argv += ["--listen", f"127.0.0.1:{port}", "--redis", redis.url]
        with running(redis):
            peer = Service("peer", argv, port, self.run_dir)
            self.services["peer"] = peer
            with running(peer):
                for name in ("peer-plain", "peer-new"):
                    if self.wanted(name):
                        self.measure(SCENARIOS[name])
                if self.wanted("peer-replay"):
                    self.prewarm_replays(peer, "peer-replay")
                    self.measure(SCENARIOS["peer-replay"])

    def run_pgbench(self) -> None:
        """The database's own limit for the proxy's claim + completion (bench/pgbench_claim.py)."""
        recreate_db(self.args.pg_dsn, PGBENCH_DB)
        try:
            dsn = pg_dsn(self.args.pg_dsn, PGBENCH_DB)
            subprocess.run(
                [sys.executable, "-m", "idemproxy", "migrate", "--store", dsn],
                check=True,
                capture_output=True,
                timeout=60,
            )
            script = pgbench_claim.write_script(self.run_dir / "pgbench-claim-complete.sql")
            values = pgbench_claim.variables(PATH)
            scenario = SCENARIOS["pgbench"]
            for threads, clients in CONCURRENCY:
                label = f"pgbench-c{clients}"
                print(f"bench: {label}: {self.args.duration:g}s …", flush=True)
                if self.args.warmup > 0:
                    pgbench_claim.run(
                        self.tools["pgbench"],
                        dsn,
                        script,
                        values,
                        clients,
                        threads,
                        self.args.warmup,
                        self.run_dir,
                        f"warm-{label}",
                    )
                before = self._ticks([], None, None)
                with PgTicks(PGBENCH_DB) as pg_ticks:
                    raw = pgbench_claim.run(
                        self.tools["pgbench"],
                        dsn,
                        script,
                        values,
                        clients,
                        threads,
                        self.args.duration,
                        self.run_dir,
                        label,
                    )
                after = self._ticks([], None, None)
                self.record(scenario, threads, clients, raw, 0, before, after, pg_ticks, None)
        finally:
            drop_db(self.args.pg_dsn, PGBENCH_DB)

    # -- measuring

    def counter_for(self, scenario: Scenario) -> Service | None:
        """Whose POST count tells how many requests executed."""
        if scenario.target == "pgbench":
            return None
        return self.services["peer" if scenario.target == "peer" else "backend"]

    def script_args(self, scenario: Scenario, label: str) -> list[str]:
        if scenario.kind == "new":
            return [f"{self.nonce}-{label}"]
        if scenario.kind == "replay":
            return [self.replay_prefix, str(self.replay_count)]
        if scenario.kind == "hot":
            return [f"{self.nonce}-{label}", str(HOT_KEYS), str(HOT_ROUNDS)]
        return []

    def key_prefix(self, scenario: Scenario, args: list[str]) -> str | None:
        """What every key of a measured run starts with (None: the run sends no key)."""
        if scenario.kind in ("new", "hot"):
            return args[0] + "-"
        if scenario.kind == "replay":
            return self.replay_prefix + "-"
        return None

    def measure(self, scenario: Scenario, concurrency: Sequence[tuple[int, int]] = ()) -> None:
        service = self.services[scenario.target]
        for threads, connections in concurrency or CONCURRENCY:
            label = f"{scenario.name}{'-' + self.variant if self.variant else ''}-c{connections}"
            print(f"bench: {label}: {self.args.duration:g}s …", flush=True)
            analyzed = scenario.target.startswith("proxy-pg")
            if analyzed:
                self.analyze_store()  # before the warm-up, which re-plans the statements
            if self.args.warmup > 0:
                warm = self.script_args(scenario, f"warm-{label}")
                run_wrk(
                    self.wrk,
                    service.url,
                    scenario.script,
                    threads,
                    connections,
                    self.args.warmup,
                    *warm,
                )
                if analyzed:
                    # Again: on a store that was empty before the warm-up, the statistics of an
                    # empty table made every plan a sequential scan, and the warm-up's rows
                    # then made each new key read 2,178 heap blocks (the 18:00 run's empty
                    # store, bench/findings.md). A store in service is never empty for long.
                    self.analyze_store()
            args = self.script_args(scenario, label)
            if self.io_probe is not None:
                self.io_probe("start")  # after the warm-up
            result = self.measured_run(scenario, service, threads, connections, args)
            if self.io_probe is not None:
                self.io_probe("stop")  # before the checks' own queries
            if scenario.store is not None:
                result.jobs_stored = self.jobs_stored(scenario.store, args[0])

    def measured_run(
        self, scenario: Scenario, service: Service, threads: int, connections: int, args: list[str]
    ) -> Result:
        counter = self.counter_for(scenario)
        uses_pg = scenario.target.startswith("proxy-pg")
        proxy_pids = [] if scenario.target == "backend" else service.pids()
        redis = self.services.get("redis-peer" if scenario.target == "peer" else "redis")
        if scenario.target not in ("peer", "proxy-pg-redis"):
            redis = None
        # Keyed runs count the executions of their own keys only (the warm-up's stragglers have
        # other keys), and the most any one key executed.
        prefix = self.key_prefix(scenario, args)
        counts0 = settled_counts(counter, prefix) if counter else {}
        metrics0 = profiling.scrape(service.admin_url) if service.admin_url else None
        before = self._ticks(proxy_pids, counter, redis)
        with PgTicks(self.database if uses_pg else None) as pg_ticks:
            raw = run_wrk(
                self.wrk,
                service.url,
                scenario.script,
                threads,
                connections,
                self.args.duration,
                *args,
            )
        after = self._ticks(proxy_pids, counter, redis)
        counts1 = settled_counts(counter, prefix) if counter else {}
        field_name = "posts" if prefix is None else "keyed"
        upstream_calls = counts1.get(field_name, 0) - counts0.get(field_name, 0)
        result = self.record(
            scenario, threads, connections, raw, upstream_calls, before, after, pg_ticks, counter
        )
        if prefix is not None and scenario.kind in ("new", "hot"):
            result.max_per_key = counts1["max_per_key"]
        if metrics0 is not None and service.admin_url:
            split = profiling.time_split(metrics0, profiling.scrape(service.admin_url))
            result.split = asdict(split) if split else None
        return result

    def record(
        self,
        scenario: Scenario,
        threads: int,
        connections: int,
        raw: dict[str, Any],
        upstream_calls: int,
        before: dict[str, float],
        after: dict[str, float],
        pg_ticks: PgTicks,
        counter: Service | None,
    ) -> Result:
        seconds = raw["duration_us"] / 1e6
        direct = scenario.target == "backend"
        cpu = self._cpu(before, after, pg_ticks.ticks, seconds, direct, counter)
        result = Result(
            scenario=scenario.name,
            title=scenario.title,
            threads=threads,
            connections=connections,
            requests=raw["requests"],
            seconds=seconds,
            rps=raw["requests"] / seconds,
            latency_ms={k: v / 1000 for k, v in raw["latency_us"].items()},
            errors=raw["errors"],
            upstream_calls=upstream_calls,
            cpu=cpu,
            variant=self.variant,
        )
        self.results.append(result)
        print(
            f"bench: {result.label}: {result.rps:,.0f} req/s, p50 {result.latency_ms['p50']:.2f}"
            f" ms, p99 {result.latency_ms['p99']:.2f} ms, errors {result.error_count}",
            flush=True,
        )
        return result

    def _ticks(
        self, proxy_pids: list[int], counter: Service | None, redis: Service | None
    ) -> dict[str, float]:
        busy, softirq = machine_ticks()
        backend = self.services.get("backend")
        return {
            "machine": busy,
            "softirq": softirq,
            "proxy": sum(process_ticks(pid) for pid in proxy_pids),
            "proxy_sys": sum(process_ticks(pid, user=False) for pid in proxy_pids),
            "backend": process_ticks(backend.pid) if backend and counter is backend else 0,
            "redis": process_ticks(redis.pid) if redis else 0,
            "wrk": children_ticks(),
        }

    @staticmethod
    def _cpu(
        before: dict[str, float],
        after: dict[str, float],
        pg_ticks: int,
        seconds: float,
        direct: bool,
        counter: Service | None,
    ) -> CpuUse:
        def pct(name: str) -> float:
            return 100.0 * (after[name] - before[name]) / TICKS / seconds

        use = CpuUse(
            proxy=0.0 if direct else pct("proxy"),
            proxy_sys=0.0 if direct else pct("proxy_sys"),
            backend=pct("backend") if counter is not None else 0.0,
            postgres=100.0 * pg_ticks / TICKS / seconds,
            redis=pct("redis"),
            wrk=pct("wrk"),
            softirq=pct("softirq"),
        )
        accounted = use.proxy + use.backend + use.postgres + use.redis + use.wrk + use.softirq
        use.other = max(0.0, pct("machine") - accounted)
        return use

    def analyze_store(self) -> None:
        """Fresh planner statistics, as autovacuum keeps them on a store in service.

        The benchmark fills an empty table within seconds, faster than autovacuum's first
        ANALYZE (its naptime is a minute). Until then the proxy's prepared statements keep the
        generic plans made for an empty table: sequential scans. One run measured replays that
        way read 1,554 heap blocks each, against 2 after an ANALYZE, at twice the PostgreSQL
        CPU per request. A store in service is analyzed; the benchmark measures that state."""
        pg(self.args.pg_dsn, "ANALYZE idemproxy.jobs, idemproxy.attempts", database=self.database)

    def jobs_stored(self, store: str, prefix: str) -> int:
        if store == "pg":
            return pg_jobs(self.args.pg_dsn, prefix, self.database)
        return sqlite_jobs(self.sqlite_path, prefix)

    def prewarm_replays(self, proxy: Service, name: str = "replay") -> None:
        """Store each replay key once, then check that a repeat is answered as a replay."""
        self.replay_prefix = f"{self.nonce}-{name}"
        self.replay_count = self.args.replay_keys
        headers = {"Content-Type": "application/json"}
        for number in range(self.args.replay_keys):
            key = {"Idempotency-Key": f"{self.replay_prefix}-{number}"}
            status, got, _ = http_request(proxy.port, "POST", PATH, headers | key, BODY)
            if status != 201 or "Idempotent-Replayed" in {k.title() for k in got}:
                raise RuntimeError(f"pre-warm of replay key {number}: {status} {got}")
        key = {"Idempotency-Key": f"{self.replay_prefix}-0"}
        status, got, _ = http_request(proxy.port, "POST", PATH, headers | key, BODY)
        replayed = {k.title(): v for k, v in got.items()}.get("Idempotent-Replayed")
        if status != 201 or replayed != "true":
            raise RuntimeError(f"a pre-warmed key was not replayed: {status} {got}")

    # -- profiles: where the proxy's CPU goes

    def profile(self, scenario: Scenario, proxy: Service) -> None:
        """py-spy samples of the proxy during an extra, unmeasured run at saturation."""
        threads, connections = CONCURRENCY[-1]
        label = f"profile-{scenario.name}-c{connections}"
        print(f"bench: {label}: {self.args.duration:g}s (py-spy) …", flush=True)
        args = self.script_args(scenario, label)
        seconds = self.args.duration + 1
        argv = wrk_argv(self.wrk, proxy.url, scenario.script, threads, connections, seconds, *args)
        raw = self.run_dir / f"{label}.txt"
        with subprocess.Popen(
            argv, env=WRK_ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        ) as load:
            time.sleep(0.5)
            spy = profiling.record(tools.bench_tool("py-spy"), proxy.pid, self.args.duration, raw)
            spy.wait(self.args.duration + 60)
            load.wait(seconds + 60)
        summary = profiling.summarise(raw)
        if summary is None:
            log = raw.with_suffix(".log")
            text = log.read_text() if log.exists() else ""
            raise RuntimeError(f"py-spy recorded nothing for {label}: {text}")
        self.profiles[scenario.name] = asdict(summary) | {"raw": str(raw.relative_to(ROOT))}

    # -- memory

    def run_memory(self) -> None:
        backend = self.services["backend"]
        long = ["--upstream-timeout", "120", "--max-wait", "120"]
        hold_env = {"IDEMPROXY_MAX_WAITERS_PER_KEY": str(self.args.hold + 100)}
        tests: list[tuple[str, dict[str, str], Callable[[Service], Any]]] = [
            (
                "proxy-hold",
                hold_env,
                lambda proxy: memory.hold_test(
                    proxy.url,
                    backend.url,
                    proxy.admin_url or "",
                    proxy.pid,
                    f"{self.nonce}-hold",
                    self.args.hold,
                ),
            ),
            (
                "proxy-bodies",
                {},
                lambda proxy: memory.bodies_test(
                    proxy.url, backend.url, proxy.pid, f"{self.nonce}-body", 100, 10 * memory.MIB
                ),
            ),
            (
                "proxy-bodies-passthrough",
                {},
                lambda proxy: memory.bodies_test(
                    proxy.url, backend.url, proxy.pid, None, 100, 10 * memory.MIB
                ),
            ),
        ]
        for name, env, test in tests:
            print(f"bench: memory: {name} …", flush=True)
            with running(self.start_proxy(name, self.pg_store(), *long, env=env)) as proxy:
                time.sleep(0.5)
                result: memory.MemoryResult = asyncio.run(test(proxy))
            self.memory_results.append(result)
            print(
                f"bench: memory: {result.title}: VmHWM {result.hwm_mb:.0f} MB, peak VmRSS "
                f"{result.rss_peak_mb:.0f} MB, statuses {result.statuses}",
                flush=True,
            )

    # -- optional: the sweeper under 1,000 expiring jobs per second

    def run_sweeper(self) -> None:
        """New keys at saturation with the sweeper idle, then with SWEEP_RATE jobs expiring per
        second (generated with one INSERT … SELECT generate_series), sweeping every second."""
        env = {"IDEMPROXY_SWEEPER__INTERVAL": "1"}
        scenario = SCENARIOS["new-pg"]
        with running(self.start_proxy("proxy-sweeper", self.pg_store(), env=env)):
            self.services["proxy-pg"] = self.services["proxy-sweeper"]
            self.variant = "sweeper-idle"
            self.measure(scenario, CONCURRENCY[-1:])
            window = self.args.warmup + self.args.duration + 3
            rows = int(SWEEP_RATE * window)
            start = time.monotonic()
            pg(
                self.args.pg_dsn,
                _EXPIRING_JOBS,
                rows,
                SWEEP_RATE,
                f"{self.nonce}-expiring",
                database=self.database,
            )
            backlog: list[int] = []
            stop = threading.Event()

            def watch() -> None:
                while not stop.wait(0.5):
                    backlog.append(self._expired_backlog())

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            self.variant = "sweeper-busy"
            try:
                self.measure(scenario, CONCURRENCY[-1:])
            finally:
                stop.set()
                watcher.join()
                self.variant = ""
            elapsed = time.monotonic() - start
            time.sleep(2.0)
            self.extras["sweeper"] = {
                "rate": SWEEP_RATE,
                "rows": rows,
                "interval": 1.0,
                "elapsed": elapsed,
                "backlog_max": max(backlog, default=0),
                "backlog_samples": backlog,
                "backlog_end": self._expired_backlog(),
                "left": pg_jobs(self.args.pg_dsn, f"{self.nonce}-expiring", self.database),
            }

    def _expired_backlog(self) -> int:
        rows = pg(
            self.args.pg_dsn,
            "SELECT count(*) FROM idemproxy.jobs WHERE expires_at <= now() "
            "AND state IN ('completed', 'released')",
            database=self.database,
        )
        return int(rows[0][0])

    # -- optional: a store of millions of jobs

    def run_big_store(self) -> None:
        """New keys and replays at saturation on an empty store, then on one of
        --big-store-rows jobs (one INSERT … SELECT generate_series, jobs and attempts)."""
        recreate_db(self.args.pg_dsn, BIG_DB)
        self.database = BIG_DB
        try:
            io: dict[str, Any] = {}
            proxy = self.start_proxy("proxy-pg", self.pg_store(), env=NO_REPLAY_CACHE)
            with running(proxy):
                self.variant = "big-store-empty"
                io["new-pg@empty"] = self.measure_io(SCENARIOS["new-pg"])
                self.prewarm_replays(proxy, "big-empty")
                io["replay-pg@empty"] = self.measure_io(SCENARIOS["replay-pg"])
                self.variant = ""
                rows = self.args.big_store_rows
                print(f"bench: big store: generating {rows:,} jobs …", flush=True)
                started = time.monotonic()
                pg(
                    self.args.pg_dsn,
                    _BIG_STORE,
                    rows,
                    database=BIG_DB,
                    session=["SET session_replication_role = replica"],
                )
                generated = time.monotonic() - started
                pg(self.args.pg_dsn, "VACUUM (ANALYZE) idemproxy.jobs", database=BIG_DB)
                pg(self.args.pg_dsn, "VACUUM (ANALYZE) idemproxy.attempts", database=BIG_DB)
                pg(self.args.pg_dsn, "CHECKPOINT", database=BIG_DB)
                prepared = time.monotonic() - started
                size = pg(
                    self.args.pg_dsn,
                    "SELECT pg_size_pretty(pg_database_size(current_database()))",
                    database=BIG_DB,
                )[0][0]
                self.variant = "big-store"
                io["new-pg@big"] = self.measure_io(SCENARIOS["new-pg"])
                self.replay_prefix, self.replay_count = "big", rows  # keys spread over them all
                io["replay-pg@big"] = self.measure_io(SCENARIOS["replay-pg"])
                self.extras["big_store"] = {
                    "rows": rows,
                    "generate_seconds": generated,
                    "prepare_seconds": prepared,
                    "size": size,
                    "io": io,
                }
        finally:
            self.variant = ""
            self.database = BENCH_DB
            drop_db(self.args.pg_dsn, BIG_DB)

    def measure_io(self, scenario: Scenario) -> dict[str, dict[str, float]]:
        """One run at saturation, with the database's buffer reads per request by relation:
        *read* blocks came from outside shared_buffers (the OS cache or the disk), *hit* from
        inside (pg_statio_user_tables and _indexes of the current database), and the
        sequential and index scans per request (pg_stat_user_tables and _indexes)."""
        snapshots: dict[str, dict[str, tuple[int, ...]]] = {}

        def probe(when: str) -> None:
            # An idle backend reports its statistics within 10 s (PostgreSQL 15's
            # PGSTAT_IDLE_INTERVAL): wait for the pool's connections to report, then read.
            time.sleep(11.0)
            snapshots[when] = self._statio()

        self.io_probe = probe
        try:
            self.measure(scenario, CONCURRENCY[-1:])
        finally:
            self.io_probe = None
        before, after = snapshots["start"], snapshots["stop"]
        requests = max(self.results[-1].requests, 1)
        fields = ("read", "hit", "seq_scans", "idx_scans")
        zero = (0, 0, 0, 0)
        return {
            name: {
                field_name: (after[name][i] - before.get(name, zero)[i]) / requests
                for i, field_name in enumerate(fields)
            }
            for name in after
        }

    def _statio(self) -> dict[str, tuple[int, ...]]:
        rows = pg(self.args.pg_dsn, _STATIO, database=self.database)
        return {str(row[0]): tuple(int(value or 0) for value in row[1:]) for row in rows}

    def stop_all(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()


# Copies of one real completed job (the pre-warmed replay key `…-big-empty-0`: its owner,
# fingerprint and stored response), under keys big-0 … big-(N-1), with one attempt each.
# session_replication_role = replica skips the foreign-key trigger: the rows satisfy it by
# construction, and checking ten million of them would double the load time.
_BIG_STORE = """
WITH template AS (
    SELECT * FROM idemproxy.jobs WHERE key LIKE '%-big-empty-0' AND state = 'completed' LIMIT 1
), jobs AS (
    INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, state, version,
                                attempt_count, completed_by, response_status, response_headers,
                                response_body, created_at, updated_at, expires_at)
    SELECT t.owner, 'big-' || g, gen_random_uuid(), t.fingerprint, t.method, t.path, 'completed',
           2, 1, 1, t.response_status, t.response_headers, t.response_body, now(), now(),
           now() + interval '1 day'
    FROM template t, generate_series(0, $1::bigint - 1) AS g
    RETURNING owner, id
)
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, state, status, finished_at)
SELECT owner, id, 1, 'http://127.0.0.1/', 'succeeded', 201, now() FROM jobs
"""

_STATIO = """
SELECT s.relname || ' (table)', s.heap_blks_read, s.heap_blks_hit, t.seq_scan, t.idx_scan
FROM pg_statio_user_tables s JOIN pg_stat_user_tables t USING (relid)
WHERE s.schemaname = 'idemproxy'
UNION ALL
SELECT s.indexrelname, s.idx_blks_read, s.idx_blks_hit, 0, i.idx_scan
FROM pg_statio_user_indexes s JOIN pg_stat_user_indexes i USING (indexrelid)
WHERE s.schemaname = 'idemproxy'
"""

# $1 jobs expiring $2 per second from one second from now, completed, with one attempt each.
_EXPIRING_JOBS = """
WITH jobs AS (
    INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, state, version,
                                completed_by, response_status, response_headers, response_body,
                                expires_at)
    SELECT 'anonymous', $3::text || '-' || g, gen_random_uuid(), repeat('0', 64), 'POST', '/orders',
           'completed', 2, 1, 201, '[["Content-Type","application/json"]]'::jsonb,
           '\\x7b7d'::bytea, now() + interval '1 second' + g * interval '1 second' / $2::int
    FROM generate_series(0, $1::int - 1) AS g
    RETURNING owner, id
)
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, state, status, finished_at)
SELECT owner, id, 1, 'http://127.0.0.1/', 'succeeded', 201, now() FROM jobs
"""


# --- facts about this machine and run --------------------------------------------------------


def command_output(argv: Sequence[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def cpu_model() -> str:
    for line in command_output(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_total() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    return "unknown"


def git_revision() -> str:
    commit = command_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = command_output(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"])
    return f"{commit} with uncommitted changes in src/" if dirty else commit


def other_processes(limit: int = 5) -> list[str]:
    """The busiest processes that are not ours, for the record of a machine that was not idle."""
    listing = command_output(["ps", "-eo", "pid=,pcpu=,args=", "--sort=-pcpu"])
    mine = {os.getpid()}
    found: list[str] = []
    for line in listing.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 3 or int(parts[0]) in mine or float(parts[1]) < 5.0:
            continue
        found.append(f"{parts[2][:70]} ({parts[1]} %)")
        if len(found) == limit:
            break
    return found


def peer_versions(bench_python: Path) -> str:
    names = ("asgi-idempotency-header", "starlette", "uvicorn", "redis")
    code = f"import importlib.metadata as m;print(' / '.join(m.version(n) for n in {names!r}))"
    return command_output([str(bench_python), "-c", code]) or "unknown"


def facts(args: argparse.Namespace, found: dict[str, str], bench_python: Path) -> dict[str, str]:
    admin = pg_admin_db(args.pg_dsn)
    pg_version = pg(args.pg_dsn, "SHOW server_version", database=admin)[0][0]
    sync = pg(args.pg_dsn, "SHOW synchronous_commit", database=admin)[0][0]
    buffers = pg(args.pg_dsn, "SHOW shared_buffers", database=admin)[0][0]
    redis = tools.version([found["redis-server"], "--version"]).split(" sha=")[0]
    nginx_version = tools.version([found["nginx"], "-v"]).rpartition("/")[2]
    return {
        "CPU": f"{cpu_model()}, {command_output(['nproc']) or os.cpu_count()} cores (nproc)",
        "Memory": memory_total(),
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "aiohttp / uvloop": f"{metadata.version('aiohttp')} / {metadata.version('uvloop')}",
        "asyncpg / aiosqlite": f"{metadata.version('asyncpg')} / {metadata.version('aiosqlite')}",
        "PostgreSQL": (
            f"{pg_version.split()[0]} on 127.0.0.1, synchronous_commit={sync}, "
            f"shared_buffers={buffers}"
        ),
        "SQLite": f"{sqlite3.sqlite_version}, a file on local disk (WAL, synchronous=FULL)",
        "Redis": redis.removeprefix("Redis server ").removeprefix("v="),
        "nginx": f"{nginx_version}; {nginx.describe()}",
        "pgbench": tools.version([found["pgbench"], "--version"]),
        "peer": (
            "asgi-idempotency-header / starlette / uvicorn / redis-py "
            f"{peer_versions(bench_python)}, one uvicorn process (uvloop, httptools)"
        ),
        "wrk": tools.version([found["wrk"], "-v"]).split(" [", 1)[0].removeprefix("wrk "),
        "idemproxy": f"{metadata.version('idemproxy')}, commit {git_revision()}",
    }


# --- entry point ---------------------------------------------------------------------------------


def estimate(args: argparse.Namespace) -> float:
    per_run = float(args.duration) + float(args.warmup) + 1.5
    runs = len(SCENARIOS) * len(CONCURRENCY) + len(PROFILED)
    total = runs * per_run + 60.0  # + starting things, pre-warming, the memory tests
    if args.sweeper:
        total += 2 * per_run + 10
    if args.big_store:
        total += 4 * per_run + args.big_store_rows / 9_000
    return total


ONLY = (*SCENARIOS, "memory", "profiles")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="bench/run",
        description="Benchmark idemproxy against its backend, nginx and an in-process peer.",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=float(env("BENCH_DURATION", "5")),
        help="seconds per measured run (env BENCH_DURATION, default 5)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=float(env("BENCH_WARMUP", "1")),
        help="seconds of uncounted warm-up before each run (env BENCH_WARMUP, default 1; 0: none)",
    )
    parser.add_argument(
        "--pg-dsn",
        default=env("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help=(
            f"an administrative DSN, used only to create and drop {BENCH_DB}, {PGBENCH_DB} and "
            f"{BIG_DB} (env BENCH_PG_DSN)"
        ),
    )
    parser.add_argument("--replay-keys", type=int, default=64, help="stored keys to replay")
    parser.add_argument(
        "--hold", type=int, default=2000, help="held duplicates in the memory test (2000)"
    )
    parser.add_argument(
        "--sweeper",
        action="store_true",
        help=f"also: new keys while {SWEEP_RATE:,} jobs expire per second (about 20 s more)",
    )
    parser.add_argument(
        "--big-store",
        action="store_true",
        help="also: new keys and replays on a store of --big-store-rows jobs (minutes more)",
    )
    parser.add_argument("--big-store-rows", type=int, default=10_000_000, metavar="N")
    parser.add_argument(
        "--only",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=[],
        metavar="NAMES",
        help=f"run only these (comma-separated; the backend direct always runs): {', '.join(ONLY)}",
    )
    parser.add_argument(
        "--output", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the report to write"
    )
    parser.add_argument(
        "--note", action="append", default=[], help="a sentence to add to the report (repeatable)"
    )
    parser.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="measure nothing: write the report and plot again from a run's results.json "
        "(after editing bench/findings.md, say)",
    )
    args = parser.parse_args(argv)
    if args.duration < 1 or args.duration > 120 or args.warmup < 0 or args.warmup > 30:
        parser.error("--duration must be 1-120 s and --warmup 0-30 s")
    unknown = [name for name in args.only if name not in ONLY]
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(ONLY)}")
    return args


def _terminate(signum: int, _frame: FrameType | None) -> None:
    print(f"bench: {signal.Signals(signum).name}: stopping what was started", file=sys.stderr)
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop our processes


def write_report(data: dict[str, Any], raw: Path, output: Path, bench_python: Path) -> list[str]:
    """docs/benchmarks.md and its plot from one run's results; the failed checks."""
    image = output.with_suffix(".png")
    output.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [str(bench_python), str(BENCH / "plot.py"), str(raw), str(image)],
        check=True,
        timeout=120,
    )
    text, failures = report.render(data, image.name)
    output.write_text(text)
    print(report.summary(data))
    print(f"bench: wrote {output} and {image}")
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        data = json.loads(args.render.read_text())
        return 1 if write_report(data, args.render, args.output, tools.bench_python()) else 0
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    found = tools.ensure_debian_tools(["wrk", "nginx", "pgbench", "redis-server"])
    bench_python = tools.bench_python()
    stamp = datetime.now(UTC)
    run_dir = BENCH / "results" / stamp.strftime("%Y%m%dT%H%M%SZ")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench: about {estimate(args):.0f} s; logs and raw results in {run_dir}", flush=True)
    others = other_processes()
    idle_before = background_busy()
    info = facts(args, found, bench_python)
    bench = Bench(args, found, bench_python, run_dir)
    recreate_db(args.pg_dsn, BENCH_DB)
    started = time.monotonic()
    try:
        bench.run_all()
    finally:
        bench.stop_all()
        drop_db(args.pg_dsn, BENCH_DB)
    elapsed = time.monotonic() - started
    idle_after = background_busy()
    when = stamp.strftime("%Y-%m-%d %H:%M UTC")
    data = {
        "when": when,
        "facts": info,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "elapsed": elapsed,
        "load": {"before": idle_before, "after": idle_after, "others": others},
        "results": [asdict(r) for r in bench.results],
        "memory": [asdict(m) for m in bench.memory_results],
        "profiles": bench.profiles,
        "extras": bench.extras,
        # Since this was added, idemproxy_upstream_seconds ends when the upstream's answer is
        # whole, before the completion write; the report subtracts that write for older runs.
        "upstream_excludes_store": True,
    }
    raw = run_dir / "results.json"
    raw.write_text(json.dumps(data, indent=2))
    failures = write_report(data, raw, args.output, bench_python)
    print(f"bench: the run took {elapsed:.0f} s")
    for line in failures:
        print(f"bench: check failed: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
