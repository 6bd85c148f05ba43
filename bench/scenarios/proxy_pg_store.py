"""Replays read from PostgreSQL: the same store, the in-process replay cache off."""

from __future__ import annotations

from common import running
from model import Scenario
from runner import NO_REPLAY_CACHE, Bench, Step

REPLAY_PG_STORE = Scenario(
    "replay-pg-store",
    "proxy replays, PostgreSQL, no in-process cache",
    "proxy-pg-store",
    "replay_keys.lua",
)


def run(bench: Bench) -> None:
    proxy = bench.start_proxy("proxy-pg-store", bench.pg_store(), env=NO_REPLAY_CACHE)
    with running(proxy):
        bench.prewarm_replays(proxy, "replay-store")
        bench.measure(REPLAY_PG_STORE)


STEP = Step("proxy-pg-store", (REPLAY_PG_STORE,), run)
