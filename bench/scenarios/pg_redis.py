"""The same PostgreSQL store with the Redis replay cache in front (`--redis`), without the
in-process cache, so that Redis is what is measured."""

from __future__ import annotations

from common import running
from model import Scenario
from runner import NO_REPLAY_CACHE, Bench, Step

NEW_PG_REDIS = Scenario(
    "new-pg-redis",
    "proxy new keys, PostgreSQL + Redis, no in-process cache",
    "proxy-pg-redis",
    "unique_key.lua",
    "pg",
)
REPLAY_PG_REDIS = Scenario(
    "replay-pg-redis",
    "proxy replays, PostgreSQL + Redis, no in-process cache",
    "proxy-pg-redis",
    "replay_keys.lua",
)


def run(bench: Bench) -> None:
    redis = bench.start_redis("redis")
    with (
        running(redis),
        running(
            bench.start_proxy(
                "proxy-pg-redis", bench.pg_store(), "--redis", redis.url, env=NO_REPLAY_CACHE
            )
        ),
    ):
        if bench.wanted("new-pg-redis"):
            bench.measure(NEW_PG_REDIS)
        if bench.wanted("replay-pg-redis"):
            bench.prewarm_replays(bench.services["proxy-pg-redis"], "replay-redis")
            bench.measure(REPLAY_PG_REDIS)


STEP = Step("proxy-pg-redis", (NEW_PG_REDIS, REPLAY_PG_REDIS), run)
