"""`serve --workers 2`: the same store and scenarios with two proxy processes on one port."""

from __future__ import annotations

from common import running, wait_all_workers
from model import WORKERS, Scenario
from runner import Bench, Step

PASSTHROUGH_W2 = Scenario(
    "passthrough-w2",
    "proxy pass-through (POST, no key), 2 workers",
    "proxy-pg-w2",
    "post.lua",
)
NEW_PG_W2 = Scenario(
    "new-pg-w2",
    "proxy new keys, PostgreSQL, 2 workers",
    "proxy-pg-w2",
    "unique_key.lua",
    "pg",
)
REPLAY_PG_W2 = Scenario(
    "replay-pg-w2", "proxy replays, PostgreSQL, 2 workers", "proxy-pg-w2", "replay_keys.lua"
)


def run(bench: Bench) -> None:
    proxy = bench.start_proxy("proxy-pg-w2", bench.pg_store(), "--workers", str(WORKERS))
    with running(proxy):
        wait_all_workers(proxy)
        for scenario in (PASSTHROUGH_W2, NEW_PG_W2):
            if bench.wanted(scenario.name):
                bench.measure(scenario)
        if bench.wanted("replay-pg-w2"):
            bench.prewarm_replays(proxy, "replay-w2")
            bench.measure(REPLAY_PG_W2)


STEP = Step("proxy-pg-w2", (PASSTHROUGH_W2, NEW_PG_W2, REPLAY_PG_W2), run)
