"""Every step of a run of the benchmark, in the order they run, and every scenario it reports.

Each module of scenarios/ defines its scenarios and the step that measures them (`STEP`: how it
starts what they need, and which --only names or option select it). A new scenario goes into
its module's step, and its name into ROWS, where its row goes in the report.
"""

from __future__ import annotations

from model import Scenario
from runner import Bench, Step
from scenarios import (
    baseline,
    big_store,
    citus,
    direct,
    memory_hwm,
    minimal,
    nginx_hop,
    peer,
    pg_redis,
    pgbench,
    proxy_pg,
    proxy_pg_store,
    sqlite,
    sweeper,
    workers,
)

# The backend starts before the first and stops after the last.
STEPS: tuple[Step, ...] = (
    direct.STEP,
    nginx_hop.STEP,
    proxy_pg.STEP,
    proxy_pg_store.STEP,
    workers.STEP,
    sqlite.STEP,
    baseline.STEP,
    pg_redis.STEP,
    citus.STEP,
    peer.STEP,
    minimal.STEP,
    pgbench.STEP,
    memory_hwm.STEP,
    sweeper.STEP,
    big_store.STEP,
)

# The order of the report's rows (docs/benchmarks.md, Results), by what is measured rather than
# by when: the baselines, the proxy on PostgreSQL and SQLite, its variants, the peer, the
# minimal proxy, pgbench.
ROWS = (
    "direct",
    "nginx",
    "passthrough",
    "new-pg",
    "new-sqlite",
    "replay-pg",
    "replay-pg-store",
    "hot-pg",
    "passthrough-w2",
    "new-pg-w2",
    "replay-pg-w2",
    "new-pg-redis",
    "replay-pg-redis",
    "new-citus",
    "replay-citus",
    "peer-plain",
    "peer-new",
    "peer-replay",
    "new-minimal",
    "pgbench",
)


def _catalogue() -> dict[str, Scenario]:
    defined = [scenario for step in STEPS for scenario in step.scenarios]
    by_name = {scenario.name: scenario for scenario in defined}
    if len(by_name) != len(defined) or set(by_name) != set(ROWS):
        raise RuntimeError(
            f"registry: the steps' scenarios {sorted(s.name for s in defined)} are not ROWS "
            f"{sorted(ROWS)}, each once"
        )
    return {name: by_name[name] for name in ROWS}


SCENARIOS = _catalogue()
# What --only accepts: the scenarios, then the other parts of a run by name (memory, profiles).
ONLY = (*SCENARIOS, *sorted(name for step in STEPS for name in step.also))


def selected(bench: Bench) -> list[Step]:
    """The steps this run measures (--only, --sweeper, --big-store), in run order."""
    return [step for step in STEPS if step.selected(bench)]
