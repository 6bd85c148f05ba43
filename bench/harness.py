"""The benchmark: backend direct vs. through idemproxy, in one run (see bench/README.md).

Starts the backend and the proxy on free loopback ports, drives them with wrk, stops everything
it started (also on failure or Ctrl-C), writes docs/benchmarks.md and prints the results table.
Run it through `bench/run`, which picks the project's virtualenv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
BENCH_DB = "idemproxy_bench"  # the only database this script creates, uses and drops
BODY = '{"amount":1250,"currency":"EUR","note":"bench"}'
PATH = "/orders"
CONCURRENCY = ((1, 1), (2, 32))  # (wrk threads, connections)
READY_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0
TICKS = os.sysconf("SC_CLK_TCK")


# --- scenarios and results -------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    target: str  # "backend", "proxy-pg", "proxy-pg-redis" or "proxy-sqlite"
    script: str  # a Lua file in bench/
    store: str | None = None  # the store whose jobs a new-key run should have written


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("direct", "backend direct (POST)", "backend", "post.lua"),
        Scenario("passthrough", "proxy pass-through (POST, no key)", "proxy-pg", "post.lua"),
        Scenario("new-pg", "proxy new keys, PostgreSQL", "proxy-pg", "unique_key.lua", "pg"),
        Scenario(
            "new-sqlite", "proxy new keys, SQLite", "proxy-sqlite", "unique_key.lua", "sqlite"
        ),
        Scenario("replay-pg", "proxy replays, PostgreSQL", "proxy-pg", "replay_keys.lua"),
        Scenario(
            "new-pg-redis",
            "proxy new keys, PostgreSQL + Redis",
            "proxy-pg-redis",
            "unique_key.lua",
            "pg",
        ),
        Scenario(
            "replay-pg-redis",
            "proxy replays, PostgreSQL + Redis",
            "proxy-pg-redis",
            "replay_keys.lua",
        ),
    )
}


@dataclass
class CpuUse:
    """CPU time during one measured run, in % of one core (the machine has nproc times 100 %)."""

    proxy: float = 0.0
    backend: float = 0.0
    postgres: float = 0.0  # the server processes serving the benchmark database
    redis: float = 0.0  # the benchmark's own redis-server (PostgreSQL + Redis runs)
    wrk: float = 0.0
    softirq: float = 0.0  # kernel interrupt work, much of it loopback TCP, charged to no process
    other: float = 0.0  # everything else: other processes on the machine, hypervisor steal


@dataclass
class Result:
    scenario: str
    title: str
    threads: int
    connections: int
    requests: int
    seconds: float
    rps: float
    latency_ms: dict[str, float]
    errors: dict[str, int]
    upstream_calls: int
    jobs_stored: int | None = None
    cpu: CpuUse = field(default_factory=CpuUse)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


# --- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    """One child process we started; `stop()` ends exactly that process."""

    def __init__(self, name: str, argv: Sequence[str], port: int, log_dir: Path) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log_dir / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches only us; we stop it ourselves
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> None:
        """Until GET / answers 200 (through the proxy that means the backend answered too)."""
        deadline = time.monotonic() + READY_TIMEOUT
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
        raise RuntimeError(f"{self.name} not ready after {READY_TIMEOUT:.0f}s: see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()  # both the proxy and the backend shut down cleanly on SIGTERM
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT)


class RedisService(Service):
    """A throwaway redis-server of our own (no persistence) for the PostgreSQL + Redis runs."""

    def __init__(self, binary: str, port: int, log_dir: Path) -> None:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(log_dir)]
        super().__init__("redis", argv, port, log_dir)
        self.url = f"redis://127.0.0.1:{port}/0"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
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
        raise RuntimeError(f"redis not ready after {READY_TIMEOUT:.0f}s: see {self.log}")


@contextlib.contextmanager
def running(service: Service) -> Iterator[Service]:
    try:
        service.wait_ready()
        yield service
    finally:
        service.stop()


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


def backend_posts(backend: Service) -> int:
    status, _, body = http_request(backend.port, "GET", "/_stats")
    if status != 200:
        raise RuntimeError(f"backend /_stats answered {status}")
    return int(json.loads(body)["posts"])


def settled_posts(backend: Service, quiet: float = 0.3, limit: float = 10.0) -> int:
    """The backend's POST count once it stops changing.

    wrk hangs up at the end of a run with requests in flight, and the proxy still finishes their
    attempts (a client hanging up cancels nothing); waiting counts them in the run they belong to.
    """
    deadline = time.monotonic() + limit
    last = backend_posts(backend)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = backend_posts(backend)
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


def process_ticks(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def children_ticks() -> float:
    usage = os.times()
    return (usage.children_user + usage.children_system) * TICKS


def background_busy(seconds: float = 2.0) -> float:
    """The machine's busy CPU over `seconds`, in % of one core."""
    busy0, _ = machine_ticks()
    time.sleep(seconds)
    busy1, _ = machine_ticks()
    return 100.0 * (busy1 - busy0) / TICKS / seconds


# --- PostgreSQL (only the benchmark's own database) --------------------------------------------


def pg_dsn(admin_dsn: str, database: str) -> str:
    base, _, _ = admin_dsn.rpartition("/")
    return f"{base}/{database}"


async def _pg(admin_dsn: str, query: str, *args: Any, database: str = BENCH_DB) -> list[Any]:
    conn = await asyncpg.connect(pg_dsn(admin_dsn, database), timeout=10)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


def pg(admin_dsn: str, query: str, *args: Any, database: str = BENCH_DB) -> list[Any]:
    return asyncio.run(_pg(admin_dsn, query, *args, database=database))


def redacted(dsn: str) -> str:
    scheme, sep, rest = dsn.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return dsn
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{host}"


def pg_admin_db(admin_dsn: str) -> str:
    return admin_dsn.rpartition("/")[2].split("?", 1)[0] or "postgres"


def recreate_bench_db(admin_dsn: str) -> None:
    admin = pg_admin_db(admin_dsn)
    pg(admin_dsn, f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)", database=admin)
    pg(admin_dsn, f"CREATE DATABASE {BENCH_DB}", database=admin)


def drop_bench_db(admin_dsn: str) -> None:
    pg(
        admin_dsn,
        f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)",
        database=pg_admin_db(admin_dsn),
    )


def pg_backend_pids(admin_dsn: str) -> set[int]:
    rows = pg(
        admin_dsn,
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        BENCH_DB,
    )
    return {int(row["pid"]) for row in rows}


def pg_jobs(admin_dsn: str, prefix: str) -> int:
    rows = pg(admin_dsn, "SELECT count(*) FROM idemproxy.jobs WHERE key LIKE $1", prefix + "-%")
    return int(rows[0][0])


def sqlite_jobs(path: Path, prefix: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        row = db.execute("SELECT count(*) FROM jobs WHERE key LIKE ?", (prefix + "-%",)).fetchone()
    return int(row[0])


# --- wrk -----------------------------------------------------------------------------------------


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() != 0:
        sys.exit("bench: wrk is not installed; install it with `sudo apt-get install -y wrk`.")
    print("bench: installing wrk (apt-get install -y wrk)…", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "wrk"]):
        subprocess.run(command, check=True, env=env, timeout=600, stdout=subprocess.DEVNULL)
    found = shutil.which("wrk")
    if not found:
        sys.exit("bench: apt-get did not install wrk.")
    return found


def wrk_version(wrk: str) -> str:
    out = subprocess.run([wrk, "-v"], capture_output=True, text=True, timeout=10, check=False)
    first = (out.stdout or out.stderr).split("\n", 1)[0]
    return first.split(" [", 1)[0].removeprefix("wrk ").strip() or "unknown"


def run_wrk(
    wrk: str, url: str, script: str, threads: int, connections: int, seconds: float, *args: str
) -> dict[str, Any]:
    argv = [
        wrk,
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(BENCH / script),
        url,
    ]
    if args:
        argv += ["--", *args]
    env = {**os.environ, "BENCH_BODY": BODY, "BENCH_PATH": PATH}
    out = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=seconds + 60, check=False
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
    wrk: str
    run_dir: Path
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    services: dict[str, Service] = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    replay_prefix: str = ""

    @property
    def sqlite_path(self) -> Path:
        return self.run_dir / "sqlite-store.db"

    def start_backend(self) -> Service:
        port = free_port()
        argv = [sys.executable, str(BENCH / "backend.py"), "--listen", f"127.0.0.1:{port}"]
        service = Service("backend", argv, port, self.run_dir)
        self.services["backend"] = service
        return service

    def start_proxy(self, target: str, store: str, *extra: str) -> Service:
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "idemproxy",
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            self.services["backend"].url,
            "--store",
            store,
            "--admin-listen",
            f"127.0.0.1:{free_port()}",  # the default 127.0.0.1:9090 may be taken
            *extra,
        ]
        service = Service(target, argv, port, self.run_dir)
        self.services[target] = service
        return service

    def run_all(self) -> None:
        with running(self.start_backend()):
            self.measure(SCENARIOS["direct"])
            with running(self.start_proxy("proxy-pg", pg_dsn(self.args.pg_dsn, BENCH_DB))):
                self.measure(SCENARIOS["passthrough"])
                self.measure(SCENARIOS["new-pg"])
                self.prewarm_replays(self.services["proxy-pg"])
                self.measure(SCENARIOS["replay-pg"])
            with running(self.start_proxy("proxy-sqlite", f"sqlite:///{self.sqlite_path}")):
                self.measure(SCENARIOS["new-sqlite"])
            self.run_redis()
        order = list(SCENARIOS)
        self.results.sort(key=lambda r: (order.index(r.scenario), r.connections))

    def run_redis(self) -> None:
        """The same PostgreSQL store with the Redis replay cache in front (`--redis`)."""
        binary = shutil.which("redis-server")
        if binary is None:
            print("bench: redis-server not installed; skipping the PostgreSQL + Redis runs")
            return
        redis = RedisService(binary, free_port(), self.run_dir)
        self.services["redis"] = redis
        store = pg_dsn(self.args.pg_dsn, BENCH_DB)
        proxy = self.start_proxy("proxy-pg-redis", store, "--redis", redis.url)
        with running(redis), running(proxy):
            self.measure(SCENARIOS["new-pg-redis"])
            self.prewarm_replays(proxy, "replay-redis")
            self.measure(SCENARIOS["replay-pg-redis"])

    def script_args(self, scenario: Scenario, label: str) -> list[str]:
        if scenario.script == "unique_key.lua":
            return [f"{self.nonce}-{label}"]
        if scenario.script == "replay_keys.lua":
            return [self.replay_prefix, str(self.args.replay_keys)]
        return []

    def measure(self, scenario: Scenario) -> None:
        service = self.services[scenario.target]
        for threads, connections in CONCURRENCY:
            label = f"{scenario.name}-c{connections}"
            print(f"bench: {label}: {self.args.duration:g}s …", flush=True)
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
            args = self.script_args(scenario, label)
            result = self.measured_run(scenario, service, threads, connections, args)
            if scenario.store is not None:
                result.jobs_stored = self.jobs_stored(scenario.store, args[0])
            self.results.append(result)
            print(
                f"bench: {label}: {result.rps:,.0f} req/s, p50 {result.latency_ms['p50']:.2f} ms,"
                f" p99 {result.latency_ms['p99']:.2f} ms, errors {result.error_count}",
                flush=True,
            )

    def measured_run(
        self, scenario: Scenario, service: Service, threads: int, connections: int, args: list[str]
    ) -> Result:
        backend = self.services["backend"]
        uses_pg = scenario.target.startswith("proxy-pg")
        pg_pids = pg_backend_pids(self.args.pg_dsn) if uses_pg else set()
        posts0 = settled_posts(backend)  # the warm-up's last attempts land before this
        before = self._ticks(service, pg_pids)
        raw = run_wrk(
            self.wrk, service.url, scenario.script, threads, connections, self.args.duration, *args
        )
        after = self._ticks(
            service, pg_pids | (pg_backend_pids(self.args.pg_dsn) if uses_pg else set())
        )
        upstream_calls = settled_posts(backend) - posts0
        seconds = raw["duration_us"] / 1e6
        return Result(
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
            cpu=self._cpu(before, after, seconds, service is backend),
        )

    def _ticks(self, service: Service, pg_pids: set[int]) -> dict[str, float]:
        busy, softirq = machine_ticks()
        return {
            "machine": busy,
            "softirq": softirq,
            "proxy": process_ticks(service.pid),
            "backend": process_ticks(self.services["backend"].pid),
            "postgres": sum(process_ticks(pid) for pid in pg_pids),
            "redis": process_ticks(self.services["redis"].pid) if "redis" in self.services else 0,
            "wrk": children_ticks(),
        }

    @staticmethod
    def _cpu(
        before: dict[str, float], after: dict[str, float], seconds: float, direct: bool
    ) -> CpuUse:
        def pct(name: str) -> float:
            return 100.0 * (after[name] - before[name]) / TICKS / seconds

        proxy = 0.0 if direct else pct("proxy")
        use = CpuUse(
            proxy=proxy,
            backend=pct("backend"),
            postgres=pct("postgres"),
            redis=pct("redis"),
            wrk=pct("wrk"),
            softirq=pct("softirq"),
        )
        accounted = use.proxy + use.backend + use.postgres + use.redis + use.wrk + use.softirq
        use.other = max(0.0, pct("machine") - accounted)
        return use

    def jobs_stored(self, store: str, prefix: str) -> int:
        if store == "pg":
            return pg_jobs(self.args.pg_dsn, prefix)
        return sqlite_jobs(self.sqlite_path, prefix)

    def prewarm_replays(self, proxy: Service, name: str = "replay") -> None:
        """Store each replay key once, then check that a repeat is answered as a replay."""
        self.replay_prefix = f"{self.nonce}-{name}"
        headers = {"Content-Type": "application/json"}
        for number in range(self.args.replay_keys):
            key = {"Idempotency-Key": f"{self.replay_prefix}-{number}"}
            status, got, _ = http_request(proxy.port, "POST", PATH, headers | key, BODY)
            if status != 201 or "Idempotent-Replayed" in got:
                raise RuntimeError(f"pre-warm of replay key {number}: {status} {got}")
        key = {"Idempotency-Key": f"{self.replay_prefix}-0"}
        status, got, _ = http_request(proxy.port, "POST", PATH, headers | key, BODY)
        if status != 201 or got.get("Idempotent-Replayed") != "true":
            raise RuntimeError(f"a pre-warmed key was not replayed: {status} {got}")

    def stop_all(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()


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


def memory() -> str:
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


def facts(args: argparse.Namespace, wrk: str) -> dict[str, str]:
    pg_version = pg(args.pg_dsn, "SHOW server_version", database=pg_admin_db(args.pg_dsn))[0][0]
    sync = pg(args.pg_dsn, "SHOW synchronous_commit", database=pg_admin_db(args.pg_dsn))[0][0]
    return {
        "CPU": f"{cpu_model()}, {command_output(['nproc']) or os.cpu_count()} cores (nproc)",
        "Memory": memory(),
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "aiohttp / uvloop": f"{metadata.version('aiohttp')} / {metadata.version('uvloop')}",
        "asyncpg / aiosqlite": f"{metadata.version('asyncpg')} / {metadata.version('aiosqlite')}",
        "PostgreSQL": f"{pg_version.split()[0]} on 127.0.0.1, synchronous_commit={sync}",
        "SQLite": f"{sqlite3.sqlite_version}, a file on local disk (WAL, synchronous=FULL)",
        "wrk": wrk_version(wrk),
        "idemproxy": f"{metadata.version('idemproxy')}, commit {git_revision()}",
    }


# --- the report ----------------------------------------------------------------------------------


def ratios(results: list[Result]) -> dict[tuple[str, int], dict[str, float]]:
    direct = {r.connections: r for r in results if r.scenario == "direct"}
    out: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        base = direct[r.connections]
        out[r.scenario, r.connections] = {
            "throughput": r.rps / base.rps,
            "p50_overhead": r.latency_ms["p50"] - base.latency_ms["p50"],
            "p99_overhead": r.latency_ms["p99"] - base.latency_ms["p99"],
        }
    return out


def results_table(results: list[Result]) -> str:
    rel = ratios(results)
    lines = [
        "| Scenario | Conns | req/s | p50 ms | p99 ms | req/s vs direct "
        "| p50 overhead ms | p99 overhead ms | Errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        x = rel[r.scenario, r.connections]
        if r.scenario == "direct":
            relative = ["1", "-", "-"]
        else:
            relative = [
                f"{x['throughput']:.3f}",
                f"{x['p50_overhead']:+.2f}",
                f"{x['p99_overhead']:+.2f}",
            ]
        cells = [
            r.title,
            str(r.connections),
            f"{r.rps:,.0f}",
            f"{r.latency_ms['p50']:.2f}",
            f"{r.latency_ms['p99']:.2f}",
            *relative,
            str(r.error_count),
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def cpu_table(results: list[Result]) -> str:
    lines = [
        "| Scenario | Conns | proxy | backend | PostgreSQL | Redis | wrk | kernel irq | other |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        c = r.cpu
        proxy = "-" if r.scenario == "direct" else f"{c.proxy:.0f} %"
        postgres = "-" if r.scenario in ("direct", "new-sqlite") else f"{c.postgres:.0f} %"
        redis = f"{c.redis:.0f} %" if r.scenario.endswith("-redis") else "-"
        cells = [r.title, str(r.connections), proxy, f"{c.backend:.0f} %", postgres, redis]
        cells += [f"{c.wrk:.0f} %", f"{c.softirq:.0f} %", f"{c.other:.0f} %"]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def check(r: Result) -> str | None:
    """What a run must show, or None when it has nothing to check."""
    conns = f"{r.connections} connection{'s' if r.connections > 1 else ''}"
    if r.jobs_stored is not None:
        ok = r.jobs_stored == r.upstream_calls and r.jobs_stored >= r.requests
        verdict = "ok" if ok else "**MISMATCH**: every new key must store one job and execute once"
        return (
            f"{r.title}, {conns}: {r.requests:,} responses, {r.jobs_stored:,} jobs stored, "
            f"{r.upstream_calls:,} upstream calls: {verdict}."
        )
    if r.scenario.startswith("replay-pg"):
        verdict = "ok" if r.upstream_calls == 0 else "**MISMATCH**: a replay must not execute"
        calls = f"{r.upstream_calls:,} upstream calls"
        return f"{r.title}, {conns}: {r.requests:,} responses, {calls}: {verdict}."
    return None


def checks(results: list[Result]) -> list[str]:
    return [f"- {line}" for r in results if (line := check(r))]


def load_note(before: float, after: float, results: list[Result], others: list[str]) -> str:
    busiest = max(r.cpu.other for r in results)
    idle = before < 10 and after < 10 and busiest < 10
    text = (
        f"Busy CPU with none of the benchmark's processes running: {before:.0f} % of one core "
        f"before the run, {after:.0f} % after it; during the measured runs, other processes used "
        f"up to {busiest:.0f} % (the column *other* below)."
    )
    if idle:
        return "The machine was idle. " + text
    seen = (
        f" Busy processes at the start (ps, CPU averaged over their life): {'; '.join(others)}."
        if others
        else ""
    )
    return (
        "**The machine was not idle during this run**: other work shared its 2 cores and the "
        "PostgreSQL server, so absolute numbers are lower and noisier than on a quiet machine. "
        + text
        + seen
    )


def render(
    results: list[Result], info: dict[str, str], args: argparse.Namespace, load: str, when: str
) -> str:
    machine = "\n".join(f"| {k} | {v} |" for k, v in info.items())
    notes = "".join(f"\n{note}\n" for note in args.note)
    return f"""# Benchmarks

Backend direct vs. through idemproxy, measured in one run of `bench/run` on {when}.
Each row is one wrk run of {args.duration:g} s (after a {args.warmup:g} s warm-up that is not
counted), at 1 connection (`wrk -t1 -c1`) and 32 connections (`wrk -t2 -c32`), against a minimal
aiohttp backend on uvloop. wrk, the backend, the proxy and PostgreSQL all share the same machine,
so these are numbers from one run on a small box: **the ratios matter more than the absolute
values.**

| Machine | |
| --- | --- |
{machine}

{load}
{notes}
## Results

*req/s vs direct* is the scenario's throughput divided by the backend's own at the same number of
connections; the overheads are the scenario's latency percentile minus the backend's (ms).

{results_table(results)}

Scenarios:
- **backend direct**: POST with a small JSON body straight to the backend (201, small JSON).
- **pass-through**: the same POST through the proxy without an `Idempotency-Key`; no storage call.
- **new keys**: every request has a key never seen before (`bench/unique_key.lua`): a claim, the
  upstream call and the completion write, on PostgreSQL or SQLite.
- **replays**: requests cycle through {args.replay_keys} keys stored beforehand
  (`bench/replay_keys.lua`); each is answered from PostgreSQL without calling the backend.
- **PostgreSQL + Redis**: the same two with `--redis` (a local redis-server of the benchmark's
  own, no persistence): a new key also looks Redis up first and caches its completion in the
  background; a replay is answered from Redis without any PostgreSQL statement.

## Where the CPU went

CPU time during each measured run, in % of one core (the machine has 200 %). *PostgreSQL* counts
the server processes connected to the benchmark database (not its WAL writer); *kernel irq* is
interrupt and softirq time, much of it loopback TCP, which Linux charges to no process; *other*
is everything else: other people's processes and hypervisor steal.

{cpu_table(results)}

## Checks

{chr(10).join(checks(results))}

## Rerun

From the repository root, with PostgreSQL reachable at `{redacted(args.pg_dsn)}`
(`--pg-dsn` or `BENCH_PG_DSN` to change it; the benchmark creates and drops only the database
`{BENCH_DB}`), run `bench/run`. It takes about {estimate(args):.0f} s; `bench/run --duration 10`
or `BENCH_DURATION=10 bench/run` makes each run longer, `bench/run --help` lists the rest. It
installs wrk with apt-get when run as root, writes this file, and keeps the raw results and the
processes' logs in `bench/results/` (not committed). Compare ratios across runs, not absolute
numbers, and prefer a quiet machine.
"""


def estimate(args: argparse.Namespace) -> float:
    per_run = float(args.duration) + float(args.warmup) + 1.0
    return len(SCENARIOS) * len(CONCURRENCY) * per_run + 10.0


# --- entry point ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="bench/run", description="Benchmark idemproxy against its backend with wrk."
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=float(env("BENCH_DURATION", "5")),
        help="seconds per measured wrk run (env BENCH_DURATION, default 5)",
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
        help=f"an administrative DSN, used only to create and drop {BENCH_DB} (env BENCH_PG_DSN)",
    )
    parser.add_argument("--replay-keys", type=int, default=64, help="stored keys to replay")
    parser.add_argument(
        "--output", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the report to write"
    )
    parser.add_argument(
        "--note", action="append", default=[], help="a sentence to add to the report (repeatable)"
    )
    args = parser.parse_args(argv)
    if args.duration < 1 or args.duration > 120 or args.warmup < 0 or args.warmup > 30:
        parser.error("--duration must be 1-120 s and --warmup 0-30 s")
    return args


def _terminate(signum: int, _frame: FrameType | None) -> None:
    print(f"bench: {signal.Signals(signum).name}: stopping what was started", file=sys.stderr)
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop our processes


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    wrk = ensure_wrk()
    stamp = datetime.now(UTC)
    run_dir = BENCH / "results" / stamp.strftime("%Y%m%dT%H%M%SZ")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench: about {estimate(args):.0f} s; logs and raw results in {run_dir}", flush=True)
    others = other_processes()
    idle_before = background_busy()
    info = facts(args, wrk)
    bench = Bench(args, wrk, run_dir)
    recreate_bench_db(args.pg_dsn)
    try:
        bench.run_all()
    finally:
        bench.stop_all()
        drop_bench_db(args.pg_dsn)
    idle_after = background_busy()
    results = bench.results
    load = load_note(idle_before, idle_after, results, others)
    when = stamp.strftime("%Y-%m-%d %H:%M UTC")
    (run_dir / "results.json").write_text(
        json.dumps({"when": when, "facts": info, "results": [asdict(r) for r in results]}, indent=2)
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(results, info, args, load, when))
    print(f"\n{results_table(results)}\n\n{cpu_table(results)}\n\n{load}\n")
    print(f"bench: wrote {args.output}")
    failed = [r for r in results if r.error_count]
    if failed:
        print(f"bench: {len(failed)} runs had errors (non-2xx or socket errors)", file=sys.stderr)
    mismatched = [line for line in checks(results) if "MISMATCH" in line]
    for line in mismatched:
        print(f"bench: check failed: {line}", file=sys.stderr)
    return 1 if failed or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
