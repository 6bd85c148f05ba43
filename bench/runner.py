"""One run of the benchmark: its state, how it starts what it measures, and how it measures.

A scenario module (scenarios/) starts what its scenarios need with `Bench.start_*` and measures
them with `Bench.measure` (wrk at each concurrency, CPU of every process, the execution checks)
or `Bench.profile` (py-spy); `Step` is how it registers that with the run (registry.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import memory
import profiling
import tools
from common import (
    BENCH,
    BENCH_DB,
    BODY,
    PATH,
    ROOT,
    TICKS,
    WRK_ENV,
    PgTicks,
    RedisService,
    Service,
    children_ticks,
    free_port,
    http_request,
    machine_ticks,
    pg,
    pg_dsn,
    pg_jobs,
    process_ticks,
    run_wrk,
    serve_argv,
    settled_counts,
    sqlite_jobs,
    wrk_argv,
)
from model import CONCURRENCY, CpuUse, Result, Scenario

HOT_KEYS = 8  # the hot-key storm: keys in use at once …
HOT_ROUNDS = 32  # … each replaced after this many requests for it per wrk thread
# The in-process replay cache off (`replay_cache.max_bytes: 0`): replays are read from the store.
NO_REPLAY_CACHE = {"IDEMPROXY_REPLAY_CACHE__MAX_BYTES": "0"}


@dataclass(frozen=True)
class Step:
    """One part of a run: the scenarios it measures and `run`, which starts what they need,
    measures them and stops it (with the backend already running)."""

    name: str
    scenarios: tuple[Scenario, ...]
    run: Callable[[Bench], None]
    also: tuple[str, ...] = ()  # other names for --only that select it ("profiles", "memory")
    option: str | None = None  # selected by this option of bench/run instead of --only
    always: bool = False  # whatever --only says (the backend direct: every ratio's baseline)

    def selected(self, bench: Bench) -> bool:
        if self.always:
            return True
        if self.option is not None:
            return bool(getattr(bench.args, self.option))
        return any(bench.wanted(name) for name in (*(s.name for s in self.scenarios), *self.also))


@dataclass
class Bench:
    """The run's options, tools and processes, and everything measured so far."""

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
    main_database: str = BENCH_DB  # … and the one of the main runs (not a variant's)
    sqlite_file: str = "sqlite-store.db"  # the SQLite proxies' store, in the run's directory
    main_sqlite_file: str = "sqlite-store.db"

    @property
    def wrk(self) -> str:
        return self.tools["wrk"]

    @property
    def sqlite_path(self) -> Path:
        return self.run_dir / self.sqlite_file

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
        self,
        target: str,
        store: str,
        *extra: str,
        env: dict[str, str] | None = None,
        python: Path | None = None,
    ) -> Service:
        port, admin = free_port(), free_port()
        upstream = self.services["backend"].url
        argv = serve_argv(port, admin, upstream, store, *extra, python=python)
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
                self.analyze_store(scenario)  # before the warm-up, which re-plans the statements
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
                    self.analyze_store(scenario)
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
        before = self.ticks(proxy_pids, counter, redis)
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
        after = self.ticks(proxy_pids, counter, redis)
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

    def ticks(
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

    def analyze_store(self, scenario: Scenario) -> None:
        """Fresh planner statistics, as autovacuum keeps them on a store in service.

        The benchmark fills an empty table within seconds, faster than autovacuum's first
        ANALYZE (its naptime is a minute). Until then the proxy's prepared statements keep the
        generic plans made for an empty table: sequential scans. One run measured replays that
        way read 1,554 heap blocks each, against 2 after an ANALYZE, at twice the PostgreSQL
        CPU per request. A store in service is analyzed; the benchmark measures that state."""
        tables = "idemproxy.jobs, idemproxy.attempts"
        if scenario.target == "proxy-pg-minimal":
            tables = "minimal.jobs"  # the minimal proxy's one table (minimal_proxy.py)
        pg(self.args.pg_dsn, f"ANALYZE {tables}", database=self.database)

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

    def stop_all(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()
