"""The benchmark's scenarios and results, shared by the harness and the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONCURRENCY = ((1, 1), (2, 32))  # (wrk threads, connections): one client, and saturation
SATURATED = CONCURRENCY[-1][1]


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    # What wrk talks to: "backend", "nginx", "proxy-pg", "proxy-pg-w2" (2 workers),
    # "proxy-pg-store" and "proxy-pg-redis" (no in-process replay cache), "proxy-sqlite", "peer"
    # (the in-process middleware) or "pgbench" (no HTTP: the database alone).
    target: str
    script: str  # a Lua file in bench/ ("" for pgbench)
    store: str | None = None  # the store whose jobs a keyed run should have written

    @property
    def kind(self) -> str:
        """plain (no key), new (a new key each request), replay, hot (few hot keys) or db."""
        return {
            "unique_key.lua": "new",
            "replay_keys.lua": "replay",
            "hot_keys.lua": "hot",
            "": "db",
        }.get(self.script, "plain")


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("direct", "backend direct (POST)", "backend", "post.lua"),
        Scenario("nginx", "nginx reverse proxy (POST)", "nginx", "post.lua"),
        Scenario("passthrough", "proxy pass-through (POST, no key)", "proxy-pg", "post.lua"),
        Scenario("new-pg", "proxy new keys, PostgreSQL", "proxy-pg", "unique_key.lua", "pg"),
        Scenario(
            "new-sqlite", "proxy new keys, SQLite", "proxy-sqlite", "unique_key.lua", "sqlite"
        ),
        Scenario(
            "replay-pg",
            "proxy replays, PostgreSQL (in-process cache)",
            "proxy-pg",
            "replay_keys.lua",
        ),
        # The same replays read from the store: `replay_cache.max_bytes: 0`.
        Scenario(
            "replay-pg-store",
            "proxy replays, PostgreSQL, no in-process cache",
            "proxy-pg-store",
            "replay_keys.lua",
        ),
        Scenario("hot-pg", "proxy hot-key storm, PostgreSQL", "proxy-pg", "hot_keys.lua", "pg"),
        # `serve --workers 2`: the same scenarios with two proxy processes on one port.
        Scenario(
            "passthrough-w2",
            "proxy pass-through (POST, no key), 2 workers",
            "proxy-pg-w2",
            "post.lua",
        ),
        Scenario(
            "new-pg-w2",
            "proxy new keys, PostgreSQL, 2 workers",
            "proxy-pg-w2",
            "unique_key.lua",
            "pg",
        ),
        Scenario(
            "replay-pg-w2", "proxy replays, PostgreSQL, 2 workers", "proxy-pg-w2", "replay_keys.lua"
        ),
        Scenario(
            "new-pg-redis",
            "proxy new keys, PostgreSQL + Redis, no in-process cache",
            "proxy-pg-redis",
            "unique_key.lua",
            "pg",
        ),
        Scenario(
            "replay-pg-redis",
            "proxy replays, PostgreSQL + Redis, no in-process cache",
            "proxy-pg-redis",
            "replay_keys.lua",
        ),
        Scenario("peer-plain", "peer app, no key (POST)", "peer", "post.lua"),
        Scenario("peer-new", "peer new keys (middleware + Redis)", "peer", "unique_key.lua"),
        Scenario("peer-replay", "peer replays (middleware + Redis)", "peer", "replay_keys.lua"),
        Scenario("pgbench", "pgbench claim + complete (no HTTP)", "pgbench", ""),
    )
}
# Measured again on a store of millions of jobs (--big-store; replays from the store, without the
# in-process cache, since the store's growth is the question), and under the sweeper (--sweeper).
BIG_STORE_SCENARIOS = ("new-pg", "replay-pg")
WORKERS = 2  # the proxy-pg-w2 scenarios: `idemproxy serve --workers 2`
WORKER_SCENARIOS = ("passthrough-w2", "new-pg-w2", "replay-pg-w2")


@dataclass
class CpuUse:
    """CPU time during one measured run, in % of one core (the machine has nproc times 100 %)."""

    proxy: float = 0.0  # the proxy under test: idemproxy, nginx (all its processes) or the peer
    backend: float = 0.0
    postgres: float = 0.0  # the server processes serving the benchmark database
    redis: float = 0.0  # the benchmark's own redis-server (PostgreSQL + Redis runs, the peer)
    wrk: float = 0.0  # the load generator: wrk, or pgbench
    softirq: float = 0.0  # kernel interrupt work, much of it loopback TCP, charged to no process
    other: float = 0.0  # everything else: other processes on the machine, hypervisor steal
    proxy_sys: float = 0.0  # the part of `proxy` spent in the kernel (system calls)


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
    max_per_key: int | None = None  # the most executions of any one key (new keys, hot keys)
    cpu: CpuUse = field(default_factory=CpuUse)
    # Per-request averages from the proxy's /metrics (profiling.TimeSplit as a dict), if any.
    split: dict[str, Any] | None = None
    variant: str = ""  # "" for the main run; "big-store", "sweeper-idle", "sweeper-busy"

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def label(self) -> str:
        return f"{self.scenario}{'@' + self.variant if self.variant else ''}-c{self.connections}"


def result_from_dict(data: dict[str, Any]) -> Result:
    data = dict(data)
    data["cpu"] = CpuUse(**data.get("cpu", {}))
    return Result(**data)
