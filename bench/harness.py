"""The benchmark: the backend direct, nginx, idemproxy and the peer, in one run (bench/README.md).

Starts the backend, nginx, the proxies, the peer and their stores on free loopback ports, drives
them with wrk (and pgbench, and an asyncio client for the memory tests), stops everything it
started (also on failure or Ctrl-C), writes docs/benchmarks.md and docs/benchmarks.png and
prints the results. Run it through `bench/run`, which picks the project's virtualenv.

This is the entry point: the options, the run and the report. The scenarios are in scenarios/,
one module each, listed in run order by registry.py; runner.py measures them, with the
processes, CPU accounting, PostgreSQL and wrk of common.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import registry
import report
import tools
from common import (
    BASE_DB,
    BENCH,
    BENCH_DB,
    BIG_DB,
    PGBENCH_DB,
    ROOT,
    background_busy,
    drop_db,
    recreate_db,
    running,
)
from machine import facts, other_processes
from model import CONCURRENCY
from runner import Bench
from scenarios.proxy_pg import PROFILED
from scenarios.sweeper import SWEEP_RATE

ONLY = registry.ONLY


def run_all(bench: Bench) -> None:
    """Every selected step with the backend running, then the results in the report's order."""
    with running(bench.start_backend()):
        for step in registry.selected(bench):
            step.run(bench)
    order = list(registry.SCENARIOS)
    variants = ["", "baseline", "sweeper-idle", "sweeper-busy", "big-store-empty", "big-store"]
    bench.results.sort(
        key=lambda r: (variants.index(r.variant), order.index(r.scenario), r.connections)
    )


def estimate(args: argparse.Namespace) -> float:
    per_run = float(args.duration) + float(args.warmup) + 1.5
    runs = len(registry.SCENARIOS) * len(CONCURRENCY) + len(PROFILED)
    total = runs * per_run + 60.0  # + starting things, pre-warming, the memory tests
    if args.sweeper:
        total += 2 * per_run + 10
    if args.big_store:
        total += 4 * per_run + args.big_store_rows / 9_000
    if args.baseline:
        total += 4 * per_run + 10
    return total


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="bench/run",
        description="Benchmark idemproxy against its backend, nginx and an in-process peer.",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=float(env("BENCH_DURATION", "5")),
        help="seconds per measured run (env BENCH_DURATION, default 5)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=float(env("BENCH_WARMUP", "1")),
        help="seconds of uncounted warm-up before each run (env BENCH_WARMUP, default 1; 0: none)",
    )
    parser.add_argument(
        "--pg-dsn",
        default=env("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help=(
            f"an administrative DSN, used only to create and drop {BENCH_DB}, {PGBENCH_DB}, "
            f"{BIG_DB} and {BASE_DB} (env BENCH_PG_DSN)"
        ),
    )
    parser.add_argument("--replay-keys", type=int, default=64, help="stored keys to replay")
    parser.add_argument(
        "--hold", type=int, default=2000, help="held duplicates in the memory test (2000)"
    )
    parser.add_argument(
        "--sweeper",
        action="store_true",
        help=f"also: new keys while {SWEEP_RATE:,} jobs expire per second (about 20 s more)",
    )
    parser.add_argument(
        "--big-store",
        action="store_true",
        help="also: new keys and replays on a store of --big-store-rows jobs (minutes more)",
    )
    parser.add_argument("--big-store-rows", type=int, default=10_000_000, metavar="N")
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also: new keys on PostgreSQL and SQLite with this git revision of the proxy, "
        f"side by side (a worktree; its own database {BASE_DB})",
    )
    parser.add_argument(
        "--only",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=[],
        metavar="NAMES",
        help=f"run only these (comma-separated; the backend direct always runs): {', '.join(ONLY)}",
    )
    parser.add_argument(
        "--output", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the report to write"
    )
    parser.add_argument(
        "--note", action="append", default=[], help="a sentence to add to the report (repeatable)"
    )
    parser.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="measure nothing: write the report and plot again from a run's results.json "
        "(after editing bench/findings.md, say)",
    )
    args = parser.parse_args(argv)
    if args.duration < 1 or args.duration > 120 or args.warmup < 0 or args.warmup > 30:
        parser.error("--duration must be 1-120 s and --warmup 0-30 s")
    unknown = [name for name in args.only if name not in ONLY]
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(ONLY)}")
    return args


def _terminate(signum: int, _frame: FrameType | None) -> None:
    print(f"bench: {signal.Signals(signum).name}: stopping what was started", file=sys.stderr)
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop our processes


def write_report(data: dict[str, Any], raw: Path, output: Path, bench_python: Path) -> list[str]:
    """docs/benchmarks.md and its plot from one run's results; the failed checks."""
    image = output.with_suffix(".png")
    output.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [str(bench_python), str(BENCH / "plot.py"), str(raw), str(image)],
        check=True,
        timeout=120,
    )
    text, failures = report.render(data, image.name)
    output.write_text(text)
    print(report.summary(data))
    print(f"bench: wrote {output} and {image}")
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        data = json.loads(args.render.read_text())
        return 1 if write_report(data, args.render, args.output, tools.bench_python()) else 0
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    found = tools.ensure_debian_tools(["wrk", "nginx", "pgbench", "redis-server"])
    bench_python = tools.bench_python()
    stamp = datetime.now(UTC)
    run_dir = BENCH / "results" / stamp.strftime("%Y%m%dT%H%M%SZ")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench: about {estimate(args):.0f} s; logs and raw results in {run_dir}", flush=True)
    others = other_processes()
    idle_before = background_busy()
    info = facts(args, found, bench_python)
    bench = Bench(args, found, bench_python, run_dir)
    recreate_db(args.pg_dsn, BENCH_DB)
    started = time.monotonic()
    try:
        run_all(bench)
    finally:
        bench.stop_all()
        drop_db(args.pg_dsn, BENCH_DB)
    elapsed = time.monotonic() - started
    idle_after = background_busy()
    when = stamp.strftime("%Y-%m-%d %H:%M UTC")
    data = {
        "when": when,
        "facts": info,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "elapsed": elapsed,
        "load": {"before": idle_before, "after": idle_after, "others": others},
        "results": [asdict(r) for r in bench.results],
        "memory": [asdict(m) for m in bench.memory_results],
        "profiles": bench.profiles,
        "extras": bench.extras,
        # Since this was added, idemproxy_upstream_seconds ends when the upstream's answer is
        # whole, before the completion write; the report subtracts that write for older runs.
        "upstream_excludes_store": True,
    }
    raw = run_dir / "results.json"
    raw.write_text(json.dumps(data, indent=2))
    failures = write_report(data, raw, args.output, bench_python)
    print(f"bench: the run took {elapsed:.0f} s")
    for line in failures:
        print(f"bench: check failed: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
