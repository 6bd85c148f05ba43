"""idemproxy on PostgreSQL, one process: pass-through, new keys, replays from the in-process
cache, the hot-key storm, and the py-spy profiles of the proxy at saturation."""

from __future__ import annotations

from common import running
from model import Scenario
from runner import Bench, Step

PASSTHROUGH = Scenario("passthrough", "proxy pass-through (POST, no key)", "proxy-pg", "post.lua")
NEW_PG = Scenario("new-pg", "proxy new keys, PostgreSQL", "proxy-pg", "unique_key.lua", "pg")
REPLAY_PG = Scenario(
    "replay-pg",
    "proxy replays, PostgreSQL (in-process cache)",
    "proxy-pg",
    "replay_keys.lua",
)
HOT_PG = Scenario("hot-pg", "proxy hot-key storm, PostgreSQL", "proxy-pg", "hot_keys.lua", "pg")
PROFILED = (PASSTHROUGH, NEW_PG, REPLAY_PG)  # py-spy runs, at saturation


def run(bench: Bench) -> None:
    with running(bench.start_proxy("proxy-pg", bench.pg_store())) as proxy:
        for scenario in (PASSTHROUGH, NEW_PG):
            if bench.wanted(scenario.name):
                bench.measure(scenario)
        if bench.wanted("replay-pg") or bench.wanted("profiles"):
            bench.prewarm_replays(proxy)
        if bench.wanted("replay-pg"):
            bench.measure(REPLAY_PG)
        if bench.wanted("hot-pg"):
            bench.measure(HOT_PG)
        if bench.wanted("profiles"):
            for scenario in PROFILED:
                bench.profile(scenario, proxy)


STEP = Step("proxy-pg", (PASSTHROUGH, NEW_PG, REPLAY_PG, HOT_PG), run, also=("profiles",))
