"""What a scenario is and what a run records, shared by the scenarios (scenarios/), the harness
and the report; registry.py has the scenarios themselves."""

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
    # (the in-process middleware), "proxy-citus" (a Citus coordinator) or "pgbench" (no HTTP:
    # the database alone).
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


WORKERS = 2  # the proxy-pg-w2 scenarios: `idemproxy serve --workers 2`


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
