"""The peer: the backend's POST in a Starlette app behind asgi-idempotency-header (peer_app.py)."""

from __future__ import annotations

from common import BENCH, Service, free_port, running
from model import Scenario
from runner import Bench, Step

PEER_PLAIN = Scenario("peer-plain", "peer app, no key (POST)", "peer", "post.lua")
PEER_NEW = Scenario("peer-new", "peer new keys (middleware + Redis)", "peer", "unique_key.lua")
PEER_REPLAY = Scenario(
    "peer-replay", "peer replays (middleware + Redis)", "peer", "replay_keys.lua"
)


def run(bench: Bench) -> None:
    redis = bench.start_redis("redis-peer")
    port = free_port()
    argv = [str(bench.bench_python), str(BENCH / "peer_app.py")]
    argv += ["--listen", f"127.0.0.1:{port}", "--redis", redis.url]
    with running(redis):
        peer = Service("peer", argv, port, bench.run_dir)
        bench.services["peer"] = peer
        with running(peer):
            for scenario in (PEER_PLAIN, PEER_NEW):
                if bench.wanted(scenario.name):
                    bench.measure(scenario)
            if bench.wanted("peer-replay"):
                bench.prewarm_replays(peer, "peer-replay")
                bench.measure(PEER_REPLAY)


STEP = Step("peer", (PEER_PLAIN, PEER_NEW, PEER_REPLAY), run)
