"""docs/benchmarks.md from one run's results (the `results.json` that bench/harness.py writes).

Everything here is computed from the numbers of the same run, so that the ratios compare like
with like. The reasoning about missed targets lives in bench/findings.md, written by people
from the evidence below, and is included as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model import CONCURRENCY, SATURATED, WORKERS, Result, result_from_dict
from registry import SCENARIOS

BENCH = Path(__file__).resolve().parent
FINDINGS = BENCH / "findings.md"
DRY_RUN_BELOW = 5.0  # seconds per run: shorter runs are marked as dry runs
NGINX_FLOOR_MS = 0.005  # wrk's latencies are whole microseconds; nginx may add "nothing"
SWEEP_P99_FACTOR = 1.2  # "without hurting p99": within 20 % of the same load with nothing to sweep


class Results:
    def __init__(self, data: dict[str, Any]) -> None:
        self.all = [result_from_dict(r) for r in data["results"]]

    def get(self, scenario: str, connections: int, variant: str = "") -> Result | None:
        for r in self.all:
            if (r.scenario, r.connections, r.variant) == (scenario, connections, variant):
                return r
        return None

    def main(self) -> list[Result]:
        return [r for r in self.all if not r.variant]


@dataclass
class Target:
    area: str
    what: str
    measured: str
    threshold: str
    verdict: str  # PASS, MISS or "not run"


def _ms(value: float) -> str:
    return f"{value:.2f} ms"


def _rate(value: float) -> str:
    return f"{value:,.0f} req/s"


def _verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**MISS**"


class _Targets:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.res = Results(data)
        self.out: list[Target] = []

    def add(
        self,
        area: str,
        what: str,
        threshold: str,
        needs: list[Result | None],
        measure: Callable[[], tuple[str, bool]],
    ) -> None:
        if any(r is None for r in needs):
            self.out.append(Target(area, what, "-", threshold, "not run"))
            return
        measured, ok = measure()
        self.out.append(Target(area, what, measured, threshold, _verdict(ok)))


def targets(data: dict[str, Any]) -> list[Target]:
    t = _Targets(data)
    _passthrough_targets(t)
    _new_key_targets(t)
    _group_commit_targets(t)
    _minimal_targets(t)
    _replay_targets(t)
    _big_store_targets(t)
    _sweeper_target(t)
    _memory_targets(t)
    return t.out


# The throughput targets, for one proxy process and, in the row after it, for `--workers 2`
# (scenario, suffix of the target's description).
_WORKER_ROWS = {
    name: ((name, ""), (f"{name}-w2", f", {WORKERS} workers"))
    for name in ("passthrough", "new-pg", "replay-pg")
}


def _throughput_ratio(
    t: _Targets,
    row: tuple[str, str, str],
    pair: tuple[Result | None, Result | None],
    other: Callable[[Result], str],
    show: Callable[[float], str],
    minimum: float,
) -> None:
    """A target row (area, what, threshold): the first result's throughput over the second's,
    at least `minimum`."""
    ours, theirs = pair

    def check() -> tuple[str, bool]:
        assert ours and theirs
        ratio = ours.rps / theirs.rps
        return f"{_rate(ours.rps)} vs {other(theirs)}: {show(ratio)}", ratio >= minimum

    t.add(*row, [ours, theirs], check)


def _percent(ratio: float) -> str:
    return f"{ratio:.0%}"


def _times(digits: int) -> Callable[[float], str]:
    return lambda ratio: f"{ratio:.{digits}f}x"


def _peer(result: Result) -> str:
    return f"peer {_rate(result.rps)}"


def _passthrough_targets(t: _Targets) -> None:
    direct1, nginx1 = t.res.get("direct", 1), t.res.get("nginx", 1)
    pt1 = t.res.get("passthrough", 1)
    nginxs = t.res.get("nginx", SATURATED)

    def latency() -> tuple[str, bool]:
        assert direct1 and nginx1 and pt1
        added = pt1.latency_ms["p50"] - direct1.latency_ms["p50"]
        floor = max(nginx1.latency_ms["p50"] - direct1.latency_ms["p50"], NGINX_FLOOR_MS)
        ratio = added / floor
        return f"+{added:.3f} ms vs nginx +{floor:.3f} ms: {ratio:.1f}x", ratio <= 3

    t.add(
        "pass-through",
        "added p50 latency at c=1, vs nginx's added latency",
        "≤ 3x",
        [direct1, nginx1, pt1],
        latency,
    )

    for scenario, workers in _WORKER_ROWS["passthrough"]:
        what = f"throughput at c={SATURATED}, vs nginx{workers}"
        pair = (t.res.get(scenario, SATURATED), nginxs)
        row = ("pass-through", what, "≥ 50 %")
        _throughput_ratio(t, row, pair, lambda r: f"nginx {_rate(r.rps)}", _percent, 0.5)


def _new_key_targets(t: _Targets) -> None:
    direct1, new1 = t.res.get("direct", 1), t.res.get("new-pg", 1)
    pgbs = t.res.get("pgbench", SATURATED)
    peers = t.res.get("peer-new", SATURATED)

    def latency() -> tuple[str, bool]:
        assert new1 and direct1
        overhead = new1.latency_ms["p50"] - direct1.latency_ms["p50"]
        return f"+{overhead:.2f} ms (p50 {_ms(new1.latency_ms['p50'])})", overhead <= 1.0

    area = "new keys, PostgreSQL"
    t.add(area, "p50 overhead over direct at c=1", "≤ 1.0 ms", [new1, direct1], latency)

    for scenario, workers in _WORKER_ROWS["new-pg"]:
        what = f"throughput at c={SATURATED}, vs pgbench claim + complete{workers}"
        pair = (t.res.get(scenario, SATURATED), pgbs)
        pgbench = lambda r: f"pgbench {r.rps:,.0f} tx/s"  # noqa: E731
        _throughput_ratio(t, (area, what, "≥ 50 %"), pair, pgbench, _percent, 0.5)

    for scenario, workers in _WORKER_ROWS["new-pg"]:
        what = f"throughput at c={SATURATED}, vs the peer's new keys{workers}"
        pair = (t.res.get(scenario, SATURATED), peers)
        _throughput_ratio(t, (area, what, "≥ 1x"), pair, _peer, _times(2), 1)


# Group commit (the issue that batched claims and completions): its targets against the peer and
# pgbench, and against the previous design measured in the same run (`--baseline REV`).
GROUP_PEER_RATIO = 1.5
GROUP_SQLITE_RATIO = 3.0
GROUP_C1_P50_MS = 0.05


def _group_commit_targets(t: _Targets) -> None:
    news, peers = t.res.get("new-pg", SATURATED), t.res.get("peer-new", SATURATED)
    pgbs = t.res.get("pgbench", SATURATED)
    area = "new keys, group commit"
    what = f"PostgreSQL throughput at c={SATURATED}, vs the peer's new keys"
    row = (area, what, f"≥ {GROUP_PEER_RATIO:g}x")
    _throughput_ratio(t, row, (news, peers), _peer, _times(2), GROUP_PEER_RATIO)
    what = f"PostgreSQL throughput at c={SATURATED}, vs pgbench claim + complete"
    pgbench = lambda r: f"pgbench {r.rps:,.0f} tx/s"  # noqa: E731
    _throughput_ratio(t, (area, what, "≥ 1x"), (news, pgbs), pgbench, _times(2), 1.0)
    revision = t.data.get("extras", {}).get("baseline", {}).get("commit", "REV")
    area = f"new keys, group commit vs {revision} (--baseline)"
    sqlite = (t.res.get("new-sqlite", SATURATED), t.res.get("new-sqlite", SATURATED, "baseline"))
    what = f"SQLite throughput at c={SATURATED}, vs the baseline's"
    baseline = lambda r: f"baseline {_rate(r.rps)}"  # noqa: E731
    row = (area, what, f"≥ {GROUP_SQLITE_RATIO:g}x")
    _throughput_ratio(t, row, sqlite, baseline, _times(2), GROUP_SQLITE_RATIO)
    direct1 = t.res.get("direct", 1)
    for scenario, store in (("new-pg", "PostgreSQL"), ("new-sqlite", "SQLite")):
        now1, base1 = t.res.get(scenario, 1), t.res.get(scenario, 1, "baseline")
        t.add(
            area,
            f"{store} p50 overhead over direct at c=1, vs the baseline's",
            f"≤ +{GROUP_C1_P50_MS:g} ms",
            [now1, base1, direct1],
            functools.partial(_p50_overhead_change, now1, base1, direct1),
        )
        nows, bases = t.res.get(scenario, SATURATED), t.res.get(scenario, SATURATED, "baseline")
        t.add(
            area,
            f"{store} p99 at c={SATURATED}, vs the baseline's",
            "not worse",
            [nows, bases],
            functools.partial(_p99_change, nows, bases),
        )


def _p50_overhead_change(
    now: Result | None, base: Result | None, direct: Result | None
) -> tuple[str, bool]:
    assert now and base and direct
    floor = direct.latency_ms["p50"]
    ours, theirs = now.latency_ms["p50"] - floor, base.latency_ms["p50"] - floor
    change = ours - theirs
    return f"+{ours:.2f} ms vs +{theirs:.2f} ms: {change:+.3f} ms", change <= GROUP_C1_P50_MS


def _p99_change(now: Result | None, base: Result | None) -> tuple[str, bool]:
    assert now and base
    ours, theirs = now.latency_ms["p99"], base.latency_ms["p99"]
    return f"{_ms(ours)} vs {_ms(theirs)}: {ours / theirs:.2f}x", ours <= theirs


def _replay_targets(t: _Targets) -> None:
    rep1, peers = t.res.get("replay-pg", 1), t.res.get("peer-replay", SATURATED)
    area = "replays, PostgreSQL"
    # With 2 workers, replays are compared with new keys on 2 workers too.
    pairs = zip(_WORKER_ROWS["replay-pg"], _WORKER_ROWS["new-pg"], strict=True)
    for (replays, workers), (new, _) in pairs:
        what = f"throughput at c={SATURATED}, vs idemproxy's own new keys{workers}"
        pair = (t.res.get(replays, SATURATED), t.res.get(new, SATURATED))
        _throughput_ratio(t, (area, what, "≥ 3x"), pair, lambda r: _rate(r.rps), _times(1), 3)

    for replays, workers in _WORKER_ROWS["replay-pg"]:
        what = f"throughput at c={SATURATED}, vs the peer's replays{workers}"
        pair = (t.res.get(replays, SATURATED), peers)
        _throughput_ratio(t, (area, what, "≥ 1x"), pair, _peer, _times(2), 1)

    def latency() -> tuple[str, bool]:
        assert rep1
        return _ms(rep1.latency_ms["p50"]), rep1.latency_ms["p50"] <= 0.6

    t.add(area, "p50 latency at c=1", "≤ 0.6 ms", [rep1], latency)


def _big_store_targets(t: _Targets) -> None:
    rows = t.data.get("extras", {}).get("big_store", {}).get("rows", 10_000_000)
    for scenario, label in (("new-pg", "new-key"), ("replay-pg", "replay")):
        empty = t.res.get(scenario, SATURATED, "big-store-empty")
        big = t.res.get(scenario, SATURATED, "big-store")

        def grown(empty: Result | None = empty, big: Result | None = big) -> tuple[str, bool]:
            assert empty and big
            change = big.rps / empty.rps - 1
            text = (
                f"{_rate(big.rps)} vs {_rate(empty.rps)} empty: {change:+.0%} (PostgreSQL CPU "
                f"per request {_pg_us(big):,.0f} vs {_pg_us(empty):,.0f} µs)"
            )
            return text, change >= -0.10

        what = f"{label} throughput at c={SATURATED} with {rows:,} stored jobs, vs an empty store"
        t.add("store growth (--big-store)", what, "within 10 %", [empty, big], grown)


def _pg_us(r: Result) -> float:
    """PostgreSQL's CPU per request (µs): steadier than throughput on a busy machine."""
    return r.cpu.postgres / 100.0 * r.seconds / max(r.requests, 1) * 1e6


# Against the minimal proxy (minimal_proxy.py: claim, forward, complete, nothing else).
MINIMAL_RATIO = 1.3
MINIMAL_PG_CPU = 0.5


def _minimal_targets(t: _Targets) -> None:
    area = "new keys, vs the minimal proxy"
    news, minimals = t.res.get("new-pg", SATURATED), t.res.get("new-minimal", SATURATED)
    what = f"PostgreSQL throughput at c={SATURATED}"
    minimal = lambda r: f"minimal {_rate(r.rps)}"  # noqa: E731
    row = (area, what, f"≥ {MINIMAL_RATIO:g}x")
    _throughput_ratio(t, row, (news, minimals), minimal, _times(2), MINIMAL_RATIO)

    def pg_cpu() -> tuple[str, bool]:
        assert news and minimals
        ratio = _pg_us(news) / _pg_us(minimals)
        text = f"{_pg_us(news):,.0f} vs {_pg_us(minimals):,.0f} µs: {ratio:.2f}x"
        return text, ratio <= MINIMAL_PG_CPU

    what = f"PostgreSQL CPU per new key at c={SATURATED}"
    t.add(area, what, f"≤ {MINIMAL_PG_CPU:g}x", [news, minimals], pg_cpu)
    new1, minimal1 = t.res.get("new-pg", 1), t.res.get("new-minimal", 1)

    def p50() -> tuple[str, bool]:
        assert new1 and minimal1
        ours, theirs = new1.latency_ms["p50"], minimal1.latency_ms["p50"]
        return f"{_ms(ours)} vs {_ms(theirs)}", ours <= theirs

    t.add(area, "p50 at c=1", "no worse", [new1, minimal1], p50)


def _sweeper_target(t: _Targets) -> None:
    idle = t.res.get("new-pg", SATURATED, "sweeper-idle")
    busy = t.res.get("new-pg", SATURATED, "sweeper-busy")
    sweeper = t.data.get("extras", {}).get("sweeper")
    rate = sweeper["rate"] if sweeper else 1000

    def sweeping() -> tuple[str, bool]:
        assert idle and busy and sweeper
        keeps_up = sweeper["backlog_max"] <= 2 * sweeper["rate"] * sweeper["interval"]
        factor = busy.latency_ms["p99"] / idle.latency_ms["p99"]
        text = (
            f"expired backlog at most {sweeper['backlog_max']:,} jobs "
            f"({sweeper['backlog_end']:,} at the end); new-key p99 "
            f"{_ms(busy.latency_ms['p99'])} vs {_ms(idle.latency_ms['p99'])} idle: {factor:.2f}x"
        )
        return text, keeps_up and factor <= SWEEP_P99_FACTOR

    t.add(
        "sweeper (--sweeper)",
        f"{rate:,} jobs expiring per second while new keys run at c={SATURATED}",
        f"backlog ≤ 2 s of expiries, p99 ≤ {SWEEP_P99_FACTOR}x idle",
        [idle, busy],
        sweeping,
    )


def _memory_targets(t: _Targets) -> None:
    memory = {m["name"]: m for m in t.data.get("memory", [])}
    for name, limit, what in (
        ("hold", 200, "proxy VmHWM with {n:,} held duplicates"),
        ("bodies", 400, "proxy VmHWM with 100 concurrent 10 MiB bodies (keys)"),
    ):
        m = memory.get(name)
        if m is None:
            t.out.append(Target("memory", what.format(n=2000), "-", f"< {limit} MB", "not run"))
            continue
        ok = m["hwm_mb"] < limit and _memory_ok(m)
        measured = f"{m['hwm_mb']:.0f} MB (idle {m['rss_idle_mb']:.0f} MB)"
        if not _memory_ok(m):
            measured += f"; answers {_statuses(m['statuses'])}"
        target = Target("memory", what.format(n=m["requests"]), measured, f"< {limit} MB", "")
        target.verdict = _verdict(ok)
        t.out.append(target)


def _memory_ok(m: dict[str, Any]) -> bool:
    """Every request answered 201; the hold test executed once and replayed the rest."""
    if {int(status) for status in m["statuses"]} != {201}:  # JSON makes the keys strings
        return False
    if m["name"] == "hold":
        return bool(m["upstream_calls"] == 1 and m["replayed"] == m["requests"] - 1)
    return bool(m["upstream_calls"] == m["requests"])


def _statuses(statuses: dict[Any, int]) -> str:
    names = {"-1": "connection error", "-2": "timeout"}
    return ", ".join(f"{n:,}x {names.get(str(s), s)}" for s, n in sorted(statuses.items()))


def targets_table(rows: list[Target]) -> str:
    lines = ["| Area | Target | Measured | Threshold | Result |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {t.area} | {t.what} | {t.measured} | {t.threshold} | {t.verdict} |" for t in rows]
    return "\n".join(lines)


# --- results ----------------------------------------------------------------------------------


def results_table(results: list[Result], res: Results) -> str:
    lines = [
        "| Scenario | Conns | req/s | p50 ms | p99 ms | req/s vs direct "
        "| p50 overhead ms | p99 overhead ms | Errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        base = res.get("direct", r.connections)
        if r.scenario == "direct" or base is None:
            relative = ["1" if r.scenario == "direct" else "-", "-", "-"]
        else:
            relative = [
                f"{r.rps / base.rps:.3f}",
                f"{r.latency_ms['p50'] - base.latency_ms['p50']:+.2f}",
                f"{r.latency_ms['p99'] - base.latency_ms['p99']:+.2f}",
            ]
        title = r.title + (f" [{r.variant}]" if r.variant else "")
        cells = [
            title,
            str(r.connections),
            f"{r.rps:,.0f}",
            f"{r.latency_ms['p50']:.2f}",
            f"{r.latency_ms['p99']:.2f}",
            *relative,
            str(r.error_count),
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


RATIOS = (
    ("nginx", "direct", "one nginx hop"),
    ("passthrough", "direct", "one idemproxy hop, no key"),
    ("passthrough", "nginx", "idemproxy pass-through vs nginx"),
    ("new-pg", "passthrough", "new keys vs pass-through: the cost of the store"),
    ("new-pg", "pgbench", "new keys vs the database's own claim + complete"),
    ("new-pg", "peer-new", "new keys vs the peer's"),
    ("new-pg", "new-minimal", "new keys vs the minimal proxy's (claim, forward, complete)"),
    ("new-sqlite", "new-pg", "SQLite vs PostgreSQL new keys"),
    ("replay-pg", "new-pg", "replays vs new keys"),
    ("replay-pg", "passthrough", "replays vs pass-through"),
    ("replay-pg", "peer-replay", "replays vs the peer's"),
    ("replay-pg", "replay-pg-store", "replays from the in-process cache vs from PostgreSQL"),
    ("replay-pg-store", "peer-replay", "replays from PostgreSQL vs the peer's"),
    ("hot-pg", "new-pg", "hot-key storm vs new keys"),
    ("passthrough-w2", "passthrough", "pass-through: 2 workers vs 1"),
    ("passthrough-w2", "nginx", "pass-through with 2 workers vs nginx"),
    ("new-pg-w2", "new-pg", "new keys: 2 workers vs 1"),
    ("new-pg-w2", "pgbench", "new keys with 2 workers vs the database's claim + complete"),
    ("new-pg-w2", "peer-new", "new keys with 2 workers vs the peer's"),
    ("replay-pg-w2", "replay-pg", "replays: 2 workers vs 1"),
    ("replay-pg-w2", "new-pg-w2", "replays vs new keys, both with 2 workers"),
    ("replay-pg-w2", "peer-replay", "replays with 2 workers vs the peer's"),
    ("new-pg-redis", "new-pg", "new keys with the Redis cache vs without"),
    ("replay-pg-redis", "replay-pg-store", "replays from Redis vs from PostgreSQL"),
    ("peer-new", "peer-plain", "the peer's new keys vs its own no-key POST"),
    ("peer-replay", "peer-plain", "the peer's replays vs its own no-key POST"),
    ("peer-plain", "direct", "the peer's app (Starlette) vs the aiohttp backend"),
)


def ratios_table(res: Results) -> str:
    heads = []
    for _, conns in CONCURRENCY:
        heads += [f"req/s ratio c={conns}", f"p50 ratio c={conns}"]
    lines = [f"| A / B | What | {' | '.join(heads)} |", "| --- | --- |" + " ---: |" * len(heads)]
    for a, b, what in RATIOS:
        cells: list[str] = []
        for _, conns in CONCURRENCY:
            ra, rb = res.get(a, conns), res.get(b, conns)
            if ra is None or rb is None:
                cells += ["-", "-"]
                continue
            cells += [
                f"{ra.rps / rb.rps:.2f}",
                f"{ra.latency_ms['p50'] / max(rb.latency_ms['p50'], 0.001):.2f}",
            ]
        if all(c == "-" for c in cells):
            continue
        lines.append(f"| {a} / {b} | {what} | {' | '.join(cells)} |")
    return "\n".join(lines)


def cpu_table(results: list[Result]) -> str:
    lines = [
        "| Scenario | Conns | proxy | backend | PostgreSQL | Redis | load generator "
        "| kernel irq | other |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        c = r.cpu
        cells = [r.title + (f" [{r.variant}]" if r.variant else ""), str(r.connections)]
        for value in (c.proxy, c.backend, c.postgres, c.redis, c.wrk, c.softirq, c.other):
            cells.append(f"{value:.0f} %" if value >= 0.5 else "-")
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def cpu_per_request_table(results: list[Result]) -> str:
    """CPU time per request (µs) of each process at saturation: what a request costs."""
    lines = [
        "| Scenario | proxy µs | of which sys µs | backend µs | PostgreSQL µs | Redis µs "
        "| total (all processes, kernel) µs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if r.connections != SATURATED or r.variant or not r.requests:
            continue
        per = 1e6 * r.seconds / r.requests / 100.0  # µs per request for 1 % of a core
        c = r.cpu
        total = c.proxy + c.backend + c.postgres + c.redis + c.wrk + c.softirq
        cells = [r.title]
        for value in (c.proxy, c.proxy_sys, c.backend, c.postgres, c.redis):
            cells.append(f"{value * per:,.0f}" if value >= 0.5 else "-")
        cells.append(f"{total * per:,.0f}")
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def split_table(results: list[Result], *, upstream_excludes_store: bool) -> str:
    """Per request, from the proxy's own metrics: the store, the upstream, and the rest."""
    lines = [
        "| Scenario | Conns | mean latency ms | store ms (calls) | store ms by operation "
        "| upstream ms | rest ms | outcomes |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for r in results:
        if r.split is None or r.variant:
            continue
        s = r.split
        store = sum(s["store_ms"].values())
        mean = r.latency_ms["mean"]
        ops = ", ".join(f"{op} {ms:.2f}" for op, ms in sorted(s["store_ms"].items())) or "-"
        total = s["requests"]
        outcomes = ", ".join(
            f"{name} {n / total:.0%}" for name, n in sorted(s["outcomes"].items(), key=_by_count)
        )
        # In runs before `upstream_excludes_store`, idemproxy_upstream_seconds ran until the
        # attempt's outcome was stored: it included the completion (or settle) write, which
        # the store column already counts.
        nested = 0.0
        if not upstream_excludes_store:
            nested = s["store_ms"].get("complete", 0.0) + s["store_ms"].get("settle", 0.0)
        upstream = max(0.0, s["upstream_ms"] - nested) if s["upstream_ms"] else 0.0
        cells = [
            r.title,
            str(r.connections),
            f"{mean:.2f}",
            f"{store:.2f} ({s['store_calls']:.1f})",
            ops,
            f"{upstream:.2f}",
            f"{mean - store - upstream:.2f}",
            outcomes,
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def group_commit_table(results: list[Result]) -> str:
    """The new-key runs with their statements per request and rows per statement (from
    idemproxy_store_batch_rows; a revision without group commit has none: one statement per
    store call), next to their throughput and CPU per request."""
    lines = [
        "| Scenario | Code | Conns | req/s | p50 ms | p99 ms | proxy CPU µs | PostgreSQL CPU µs "
        "| statements per request (claim / complete) | rows per statement (claim / complete) "
        "| claim statements by rows |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for r in results:
        if r.split is None or r.variant not in ("", "baseline") or "new" not in r.split["outcomes"]:
            continue
        s = r.split
        per = r.seconds / max(r.requests, 1) * 1e6 / 100.0
        statements, rows = s.get("statements", {}), s.get("rows_per_statement", {})
        if statements:
            counts = " / ".join(f"{statements.get(k, 0):.2f}" for k in ("claim", "complete"))
            sizes = " / ".join(f"{rows.get(k, 0):.1f}" for k in ("claim", "complete"))
            by_rows = s.get("statement_sizes", {}).get("claim", {})
            total = sum(by_rows.values()) or 1
            spread = ", ".join(f"{size}: {n / total:.0%}" for size, n in by_rows.items())
        else:
            counts, sizes, spread = f"{s['store_calls']:.2f} in all (one per call)", "1", "-"
        cells = [
            r.title,
            "baseline" if r.variant else "this run's",
            str(r.connections),
            _rate(r.rps),
            _ms(r.latency_ms["p50"]),
            _ms(r.latency_ms["p99"]),
            f"{r.cpu.proxy * per:,.0f}",
            f"{r.cpu.postgres * per:,.0f}" if r.cpu.postgres else "-",
            counts,
            sizes,
            spread or "-",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def _by_count(item: tuple[str, float]) -> float:
    return -item[1]


def profiles_section(profiles: dict[str, dict[str, Any]]) -> str:
    if not profiles:
        return "Not run in this run (`--only` left out `profiles`)."
    parts: list[str] = []
    for name, p in profiles.items():
        title = SCENARIOS[name].title
        components = "\n".join(f"| {c} | {pct:.1f} % |" for c, pct in p["components"][:10])
        functions = "\n".join(f"| `{f}` | {pct:.1f} % |" for f, pct in p["functions"][:12])
        inclusive = "\n".join(f"| `{f}` | {pct:.1f} % |" for f, pct in p["inclusive"][:12])
        parts.append(
            f"""#### {title}, c={SATURATED}

{p["samples"]:,} samples of the proxy (py-spy --native at 200 Hz; raw stacks: `{p["raw"]}`),
{p["syscall_pct"]:.0f} % of them in a system call.

| Component (innermost frame), all samples | share |
| --- | ---: |
{components}

| Hottest functions (self), samples not in a system call | share |
| --- | ---: |
{functions}

| idemproxy functions (inclusive), samples not in a system call | share |
| --- | ---: |
{inclusive}
"""
        )
    return "\n".join(parts)


def memory_table(memory: list[dict[str, Any]]) -> str:
    if not memory:
        return "Not run in this run."
    lines = [
        "| Test | VmHWM MB | peak VmRSS MB | idle VmRSS MB | requests | answers "
        "| upstream calls | replayed | held at once | seconds |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for m in memory:
        held = f"{m['held_peak']:,}" if m["name"] == "hold" else "-"
        cells = [
            m["title"],
            f"{m['hwm_mb']:.0f}",
            f"{m['rss_peak_mb']:.0f}",
            f"{m['rss_idle_mb']:.0f}",
            f"{m['requests']:,}",
            _statuses(m["statuses"]),
            f"{m['upstream_calls']:,}",
            f"{m['replayed']:,}",
            held,
            f"{m['seconds']:.1f}",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    notes = [note for m in memory for note in m.get("notes", [])]
    return "\n".join(lines) + "".join(f"\n\nNote: {note}." for note in notes)


def optional_section(data: dict[str, Any], res: Results) -> str:
    extras = data.get("extras", {})
    parts: list[str] = []
    big = extras.get("big_store")
    if big:
        rows = [r for r in res.all if r.variant.startswith("big-store")]
        parts.append(
            f"### A store of {big['rows']:,} jobs (`--big-store`)\n\n"
            f"Generated with one `INSERT … SELECT generate_series` (jobs and their attempts) in "
            f"{big['generate_seconds']:.0f} s, then `VACUUM (ANALYZE)` and `CHECKPOINT` "
            f"({big['prepare_seconds']:.0f} s in all); the database took {big['size']}. New keys "
            f"insert into its indexes; replays draw keys from all {big['rows']:,} stored jobs "
            "(the empty store's replays cycle through the few pre-warmed keys).\n\n"
            + results_table(rows, res)
            + _io_table(big.get("io", {}))
        )
    else:
        parts.append(
            "### A store of 10 million jobs (`--big-store`)\n\nNot run in this run: it takes "
            "several minutes (`bench/run --big-store`)."
        )
    sweeper = extras.get("sweeper")
    if sweeper:
        rows = [r for r in res.all if r.variant.startswith("sweeper")]
        samples = ", ".join(f"{n:,}" for n in sweeper["backlog_samples"])
        parts.append(
            f"### The sweeper under {sweeper['rate']:,} expiring jobs per second (`--sweeper`)\n\n"
            f"{sweeper['rows']:,} completed jobs expiring {sweeper['rate']:,} per second, "
            f"inserted with one `INSERT … SELECT generate_series`; the proxy sweeps every "
            f"{sweeper['interval']:g} s in batches of 500. Expired jobs not yet deleted, sampled "
            f"every 0.5 s during the busy run: {samples or '-'}; {sweeper['backlog_end']:,} two "
            f"seconds after it; {sweeper['left']:,} of the generated jobs left.\n\n"
            + results_table(rows, res)
        )
    else:
        parts.append(
            "### The sweeper under 1,000 expiring jobs per second (`--sweeper`)\n\n"
            "Not run in this run (`bench/run --sweeper`)."
        )
    return "\n\n".join(parts)


def _io_table(io: dict[str, dict[str, dict[str, float]]]) -> str:
    """PostgreSQL buffer reads per request, by relation, for each big-store run."""
    if not io:
        return ""
    runs = list(io)
    relations = sorted({name for run in io.values() for name in run})
    head = " | ".join(f"{run} read / hit / scans" for run in runs)
    lines = [
        "",
        "",
        "PostgreSQL blocks per request by relation: *read* from outside shared_buffers (the OS "
        "cache or the disk), *hit* inside it, and *scans* per request: index scans, plus "
        "sequential scans after a + for tables (pg_statio and pg_stat of the benchmark's "
        "database; everything in the database during the run, the proxy's housekeeping too).",
        "",
        f"| Relation | {head} |",
        "| --- |" + " ---: |" * len(runs),
    ]
    for relation in relations:
        cells = []
        for run in runs:
            value = io[run].get(relation)
            if value is None:
                cells.append("-")
                continue
            scans = f"{value.get('idx_scans', 0):.1f}"
            if value.get("seq_scans"):
                scans += f" + {value['seq_scans']:.3f}"
            cells.append(f"{value['read']:.2f} / {value['hit']:.1f} / {scans}")
        lines.append(f"| {relation} | {' | '.join(cells)} |")
    return "\n".join(lines)


# --- checks ------------------------------------------------------------------------------------


def check(r: Result) -> str | None:
    """What a run must show, or None when it has nothing to check."""
    conns = f"{r.connections} connection{'s' if r.connections > 1 else ''}"
    title = r.title + (f" [{r.variant}]" if r.variant else "")
    kind = SCENARIOS[r.scenario].kind
    once = r.max_per_key in (None, 1)
    if kind == "hot" and r.jobs_stored is not None:
        ok = once and r.jobs_stored == r.upstream_calls and r.requests > r.jobs_stored
        verdict = "ok" if ok else "**MISMATCH**: each hot key must execute exactly once"
        return (
            f"{title}, {conns}: {r.requests:,} responses, {r.jobs_stored:,} keys (jobs stored), "
            f"{r.upstream_calls:,} upstream calls{_per_key(r)}: {verdict}."
        )
    if kind == "new" and r.jobs_stored is not None:
        ok = once and r.jobs_stored == r.upstream_calls and r.jobs_stored >= r.requests
        verdict = "ok" if ok else "**MISMATCH**: every new key must store one job and execute once"
        return (
            f"{title}, {conns}: {r.requests:,} responses, {r.jobs_stored:,} jobs stored, "
            f"{r.upstream_calls:,} upstream calls{_per_key(r)}: {verdict}."
        )
    if kind == "new" and r.scenario.startswith("peer"):
        ok = once and r.upstream_calls >= r.requests
        verdict = "ok" if ok else "**MISMATCH**: every new key must execute"
        return (
            f"{title}, {conns}: {r.requests:,} responses, {r.upstream_calls:,} executions"
            f"{_per_key(r)}: {verdict}."
        )
    if kind == "replay":
        verdict = "ok" if r.upstream_calls == 0 else "**MISMATCH**: a replay must not execute"
        calls = f"{r.upstream_calls:,} upstream calls"
        return f"{title}, {conns}: {r.requests:,} responses, {calls}: {verdict}."
    return None


def _per_key(r: Result) -> str:
    return "" if r.max_per_key is None else f" (at most {r.max_per_key} per key)"


def checks(data: dict[str, Any]) -> list[str]:
    res = Results(data)
    lines = [f"- {line}" for r in res.all if (line := check(r))]
    for r in res.all:
        if r.error_count:
            lines.append(
                f"- {r.title} [{r.label}]: **{r.error_count:,} errors** (non-2xx or socket "
                f"errors: {r.errors})."
            )
    for m in data.get("memory", []):
        verdict = "ok" if _memory_ok(m) else "**MISMATCH**"
        lines.append(
            f"- memory, {m['title']}: answers {_statuses(m['statuses'])}, "
            f"{m['upstream_calls']:,} upstream calls, {m['replayed']:,} replayed: {verdict}."
        )
    return lines


def failures(data: dict[str, Any]) -> list[str]:
    return [line for line in checks(data) if "MISMATCH" in line or "errors**" in line]


# --- the page ----------------------------------------------------------------------------------


def load_note(data: dict[str, Any], results: list[Result]) -> str:
    load = data["load"]
    before, after, others = load["before"], load["after"], load["others"]
    busiest = max((r.cpu.other for r in results), default=0.0)
    idle = before < 10 and after < 10 and busiest < 10
    text = (
        f"Busy CPU with none of the benchmark's processes running: {before:.0f} % of one core "
        f"before the run, {after:.0f} % after it; during the measured runs, other processes used "
        f"up to {busiest:.0f} % (the column *other* below)."
    )
    if idle:
        return "The machine was idle. " + text
    seen = (
        f" Busy processes at the start (ps, CPU averaged over their life): {'; '.join(others)}."
        if others
        else ""
    )
    return (
        "**The machine was not idle during this run**: other work shared its cores and the "
        "PostgreSQL server, so absolute numbers are lower and noisier than on a quiet machine. "
        + text
        + seen
    )


def render(data: dict[str, Any], image: str) -> tuple[str, list[str]]:
    res = Results(data)
    main = res.main()
    args = data["args"]
    machine = "\n".join(f"| {k} | {v} |" for k, v in data["facts"].items())
    notes = "".join(f"\n{note}\n" for note in args["note"])
    dry = ""
    if args["duration"] < DRY_RUN_BELOW:
        dry = (
            f"\n> **Dry run** ({args['duration']:g} s per measurement, on a busy machine): it "
            "shows that every scenario works end to end. It is not the record; the record is "
            "`bench/run` with its default durations on a quiet machine.\n"
        )
    findings = FINDINGS.read_text().strip() if FINDINGS.exists() else "None written yet."
    findings = findings.split("\n", 1)[1].strip() if findings.startswith("# ") else findings
    # Its sections sit under the report's "## Findings".
    lines = findings.split("\n")
    findings = "\n".join("#" + line if line.startswith("## ") else line for line in lines)
    check_lines = checks(data)
    excludes_store = data.get("upstream_excludes_store", False)
    upstream_source = (
        "histogram, which ends when the upstream's answer is whole"
        if excludes_store
        else "histogram minus the completion write it includes"
    )
    text = f"""# Benchmarks

The backend direct, nginx, idemproxy and an in-process peer, measured in one run of `bench/run`
on {data["when"]} ({data["elapsed"]:.0f} s). Each wrk row is one run of {args["duration"]:g} s
(after a {args["warmup"]:g} s warm-up that is not counted), at 1 connection (`wrk -t1 -c1`) and
{SATURATED} connections (`wrk -t2 -c{SATURATED}`). wrk, the backend, the proxies and PostgreSQL
all share the same machine, so these are numbers from one run on a small box: **the ratios,
measured in the same run, matter more than the absolute values.**
{dry}
| Machine | |
| --- | --- |
{machine}

{load_note(data, main)}
{notes}
## Targets

{targets_table(targets(data))}

![Throughput and latency of every scenario]({image})

## Results

*req/s vs direct* is the scenario's throughput divided by the backend's own at the same number of
connections; the overheads are the scenario's latency percentile minus the backend's (ms).
pgbench's row counts transactions (one claim and one completion each) with no HTTP at all.

{results_table(main, res)}

Scenarios:
- **backend direct**: POST with a small JSON body straight to the backend (aiohttp on uvloop, one
  process; 201, small JSON).
- **nginx**: the same POST through nginx as a plain reverse proxy (`bench/nginx.py`; nginx
  {data["facts"]["nginx"]}): the floor for one proxy hop.
- **pass-through**: the same POST through idemproxy without an `Idempotency-Key`; no storage call.
- **new keys**: every request has a key never seen before (`bench/unique_key.lua`): a claim, the
  upstream call and the completion write, on PostgreSQL or SQLite.
- **replays**: requests cycle through {args["replay_keys"]} keys stored beforehand
  (`bench/replay_keys.lua`); each is answered from the store without calling the backend.
- **hot-key storm**: every connection sends the same 8 keys in turn, each replaced by a new key
  after 32 requests per wrk thread (`bench/hot_keys.lua`): most requests are duplicates of a key
  in flight (held, then replayed) or just completed (replayed).
- **PostgreSQL + Redis**: new keys and replays with `--redis` (a local redis-server of the
  benchmark's own, no persistence) in front of the same PostgreSQL store.
- **peer**: what users would pick instead: the same POST in a Starlette app on uvicorn behind
  `asgi-idempotency-header`'s middleware with its Redis backend (`bench/peer_app.py`, in
  `build/bench-peer-venv`), with no key, new keys and replays. It does less than idemproxy: no
  fingerprint, no owner scope, no durable store (Redis without persistence), duplicates in flight
  get 409 at once instead of being held, and replays drop the `Location` header.
- **pgbench**: the database's own limit for the proxy's claim and completion
  (`bench/pgbench_claim.py` turns the proxy's own two statements into a pgbench script;
  prepared, each statement its own transaction, `synchronous_commit` as configured).

## Ratios

Scenario A's throughput and p50 latency divided by scenario B's, at the same concurrency.

{ratios_table(res)}

## Where the time goes

### Per request, from the proxy's own metrics

The proxy's `/metrics` (store and upstream call histograms, requests by outcome) read before and
after each measured run, divided by the requests in it: time waiting on the store (all calls;
*calls* is store calls per request), time waiting on the upstream (the proxy's upstream
{upstream_source}), and the *rest* (the client's mean latency
minus both): the proxy's own CPU, its event loop's queue, and the loopback hops. Under load the
store and upstream times include waiting for the proxy's own event loop, busy with other
requests.

{split_table(main, upstream_excludes_store=excludes_store)}

### CPU per request

CPU time that one request costs each process at c={SATURATED} (its CPU % x run time / requests);
*proxy* is idemproxy, nginx (master and worker) or the peer's one process (middleware and app),
*sys* its time in the kernel (system calls: socket reads and writes). The total adds wrk and
kernel interrupt time. It depends much less than throughput on how busy the machine is.

{cpu_per_request_table(main)}

### Group commit: statements and commits per new key

Claims and completions that queue while one of their statements is in flight go out together,
one statement and one commit per batch (docs/operations.md, "Group commit"). Per new key: the
statements of each kind (each its own transaction and commit), the rows each carried, and how
many claim statements carried how many rows, from the proxy's `idemproxy_store_batch_rows`;
with `--baseline REV`, the same runs with that revision of the proxy, in this run.
{_baseline_note(data)}
{group_commit_table(res.all)}

### Where the proxy's CPU goes

py-spy samples the proxy whenever it is not idle: running, or runnable and waiting for a CPU.
A write to a loopback socket wakes its reader (wrk, the backend, PostgreSQL), which on a busy
2-core machine often takes the CPU from the writer there and then, so the *system calls* share
is mostly that wait, not CPU: the proxy's system CPU is the *sys* column above. The function
tables therefore leave system calls out and show where the proxy's own (user) CPU goes.

{profiles_section(data.get("profiles", {}))}

## Memory

The proxy's resident set, from /proc/PID/status (VmHWM: the high-water mark of the process's
life; each test uses a fresh proxy), under 2,000 concurrent connections holding duplicates of one
key in flight at a slow backend (an asyncio client; `max_waiters_per_key` raised for it), and
under 100 concurrent 10 MiB request bodies (`application/octet-stream`, with keys, and without:
pass-through).

{memory_table(data.get("memory", []))}

## Store growth and the sweeper

{optional_section(data, res)}

## Findings

{findings}

## Where the CPU went, per run

CPU time during each measured run, in % of one core (the machine has nproc x 100 %). *proxy* is
idemproxy, nginx or the peer; *PostgreSQL* counts the server processes connected to the
benchmark's database (not its WAL writer or checkpointer); *load generator* is wrk (pgbench for
its row); *kernel irq* is interrupt and softirq time, much of it loopback TCP, which Linux charges
to no process; *other* is everything else: other people's processes and hypervisor steal.

{cpu_table(res.all)}

## Checks

{chr(10).join(check_lines) if check_lines else "Nothing to check in this run."}

## Rerun

From the repository root, with PostgreSQL reachable at `{args["pg_dsn"].split("@")[-1]}`
(`--pg-dsn` or `BENCH_PG_DSN`; the benchmark creates and drops only its own databases
`idemproxy_bench`, `idemproxy_bench_pg` and, with `--big-store` and `--baseline`,
`idemproxy_bench_big` and `idemproxy_bench_base`), run
`bench/run` (about 5 minutes with the default durations; `--sweeper` adds under a minute,
`--big-store` about a quarter of an hour on a 2-core box).
It installs wrk, nginx-light, pgbench and redis-server with apt-get when run as root (and stops
otherwise), creates its own virtualenv `build/bench-peer-venv` for the peer, the plot and py-spy,
writes this file and its plot, and keeps the raw results, profiles and logs in `bench/results/`
(not committed). `bench/run --help` lists the options. Compare ratios across runs, not absolute
numbers, and prefer a quiet machine.
"""
    return text, failures(data)


def _baseline_note(data: dict[str, Any]) -> str:
    baseline = data.get("extras", {}).get("baseline")
    if not baseline:
        return "\nNo baseline in this run (`bench/run --baseline REV`).\n"
    return (
        f"\nBaseline: `{baseline['revision']}` (commit {baseline['commit']}), checked out beside "
        "the working tree and run by the same Python, on its own database and SQLite file.\n"
    )


def summary(data: dict[str, Any]) -> str:
    res = Results(data)
    return (
        f"\n{results_table(res.all, res)}\n\n{targets_table(targets(data))}\n\n"
        f"{memory_table(data.get('memory', []))}\n"
    )
