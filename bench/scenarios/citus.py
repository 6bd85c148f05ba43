"""idemproxy on a Citus cluster, one process: new keys and replays through the coordinator of a
coordinator and two workers started for the run on this machine (the test suite's cluster,
tests/support/citus.py), both tables distributed by owner (`idemproxy migrate --distribute`).
Reported next to new-pg and replay-pg: on one machine they show the coordinator's extra hop,
not what more machines would add (docs/deploy.md, "What one machine cannot show")."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from common import running
from model import Scenario
from runner import Bench, Step

ROOT = Path(__file__).resolve().parents[2]
NEW_CITUS = Scenario(
    "new-citus", "proxy new keys, Citus (coordinator + 2 workers)", "proxy-citus", "unique_key.lua"
)
REPLAY_CITUS = Scenario(
    "replay-citus",
    "proxy replays, Citus (coordinator + 2 workers, in-process cache)",
    "proxy-citus",
    "replay_keys.lua",
)


def run(bench: Bench) -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.support.citus import CitusCluster
    from tests.support.stores import distribute_postgres

    cluster = CitusCluster()
    try:
        cluster.start()
        dsn = asyncio.run(cluster.create_database("idemproxy_bench"))
        asyncio.run(distribute_postgres(dsn))
        with running(bench.start_proxy("proxy-citus", dsn)) as proxy:
            if bench.wanted("new-citus"):
                bench.measure(NEW_CITUS)
            if bench.wanted("replay-citus"):
                bench.prewarm_replays(proxy, "replay-citus")
                bench.measure(REPLAY_CITUS)
    finally:
        cluster.destroy()


STEP = Step("proxy-citus", (NEW_CITUS, REPLAY_CITUS), run)
