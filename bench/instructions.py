"""Instructions the proxy executes per request, for the working tree against another revision.

On a shared 2-core machine two runs minutes apart differ by more than most single changes
(bench/findings.md), so wall-clock A/B pairs need many repeats. Instruction counts drift
far less: the proxy runs under valgrind's callgrind, which counts the instructions it executes,
not how long they take. Only what happens while wrk runs at one connection is counted
(`callgrind_control` switches counting on and off around it), less what the process does idle
for as long (its timers), divided by wrk's request count. Runs on a busy machine still differ by
1-2 %: repeat them, or run on an idle one, before reading a change of that size.
What it does not show: system-call time, cache misses, and effects that only appear under
concurrency (c=32); confirm a change that matters there with `bench/run`.

    bench/compare                       # the working tree against HEAD
    bench/compare --baseline 324a417    # against any revision (checked out with git worktree)
    bench/compare --only replay --seconds 6 --repeat 3
    bench/compare --only replay --keep-dumps dumps   # then: callgrind_annotate dumps/current.*

Uses the project's .venv for both (the baseline's `src/` first on PYTHONPATH), the local
PostgreSQL (`--pg-dsn`, a database of its own, created and dropped) and wrk and valgrind from
Debian's packages (installed when missing and run as root, as by bench/run).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import common
import registry
import tools

# One per run: two runs at once must not drop each other's database under their proxies.
DATABASE = f"idemproxy_bench_instructions_{os.getpid()}"
# The names of --only, and the scenarios of bench/run whose wrk scripts they send (registry.py).
_MEASURED = {"passthrough": "passthrough", "new": "new-pg", "replay": "replay-pg"}
SCENARIOS = {name: registry.SCENARIOS[scenario].script for name, scenario in _MEASURED.items()}
REPLAY_KEYS = 64
CALLGRIND_READY_TIMEOUT = 180.0  # start-up under callgrind is about 50 times slower


@dataclass
class Counted:
    requests: int
    instructions: int
    idle: int  # counted while no request came, for as long as the requests took

    @property
    def per_request(self) -> float:
        return (self.instructions - self.idle) / max(self.requests, 1)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    wrk = tools.ensure_debian_tools(["wrk"])["wrk"]
    valgrind = _valgrind()
    runs: list[dict[str, dict[str, Counted]]] = []
    with tempfile.TemporaryDirectory(prefix="idemproxy-instructions-") as scratch:
        work = Path(scratch)
        with common.worktree(args.baseline, work / "baseline") as baseline:
            port = common.free_port()
            listen = ["--listen", f"127.0.0.1:{port}"]
            backend_argv = [sys.executable, str(common.BENCH / "backend.py"), *listen]
            backend = common.Service("backend", backend_argv, port, work)
            with common.running(backend):
                for _ in range(args.repeat):  # alternately, so that a busy spell hits both
                    sources = (("baseline", baseline), ("current", common.ROOT))
                    runs.append(
                        {
                            label: _measure(args, wrk, valgrind, backend, source, work, label)
                            for label, source in sources
                        }
                    )
        if args.keep_dumps is not None:
            _keep_dumps(work, args.keep_dumps)
    _print(args, runs)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="a git revision (default HEAD)")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    parser.add_argument("--seconds", type=float, default=4.0, help="counted seconds per scenario")
    parser.add_argument(
        "--repeat", type=int, default=1, help="pairs of runs; the median ratio is reported"
    )
    parser.add_argument(
        "--keep-dumps",
        type=Path,
        metavar="DIR",
        help="copy callgrind's dumps here, to compare functions with callgrind_annotate",
    )
    parser.add_argument(
        "--pg-dsn",
        default=os.environ.get("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help=f"an administrative DSN, used only to create and drop {DATABASE}",
    )
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    return args


def _keep_dumps(work: Path, keep: Path) -> None:
    keep.mkdir(parents=True, exist_ok=True)
    for dump in work.glob("*.out*"):
        if _totals(dump) > 0:
            shutil.copy2(dump, keep / dump.name)


def _valgrind() -> str:
    found = tools.which("valgrind")
    if found is None:
        tools.DEBIAN_PACKAGES.setdefault("valgrind", "valgrind")
        found = tools.ensure_debian_tools(["valgrind"])["valgrind"]
    return found


def _measure(
    args: argparse.Namespace,
    wrk: str,
    valgrind: str,
    backend: common.Service,
    source: Path,
    work: Path,
    label: str,
) -> dict[str, Counted]:
    common.recreate_db(args.pg_dsn, DATABASE)
    try:
        with _proxy_under_callgrind(args, valgrind, backend, source, work, label) as proxy:
            return {
                name: _count(wrk, proxy, work, label, name, args.seconds)
                for name in args.only.split(",")
            }
    finally:
        common.drop_db(args.pg_dsn, DATABASE)


@contextlib.contextmanager
def _proxy_under_callgrind(
    args: argparse.Namespace,
    valgrind: str,
    backend: common.Service,
    source: Path,
    work: Path,
    label: str,
) -> Iterator[common.Service]:
    port, admin = common.free_port(), common.free_port()
    store = common.pg_dsn(args.pg_dsn, DATABASE)
    argv = [
        valgrind,
        "--tool=callgrind",
        "--instr-atstart=no",  # counted only while `callgrind_control -i on` says so
        "--separate-threads=yes",  # a dump per thread: the event loop apart from the log writer
        f"--callgrind-out-file={work / label}.%p.out",
        *common.serve_argv(port, admin, backend.url, store),
    ]
    proxy = common.Service(f"proxy-{label}", argv, port, work, {"PYTHONPATH": str(source / "src")})
    try:
        proxy.wait_ready(CALLGRIND_READY_TIMEOUT)
        yield proxy
    finally:
        proxy.stop()


def _count(
    wrk: str, proxy: common.Service, work: Path, label: str, name: str, seconds: float
) -> Counted:
    script = SCENARIOS[name]
    if name == "replay":
        _store_replay_keys(proxy)
    # Warm: imports on first use, prepared statements, the upstream connection; not counted.
    common.run_wrk(wrk, proxy.url, script, 1, 1, 2, *_script_args(name, f"{label}-warm"))
    started = time.monotonic()
    with _counting(proxy, work, f"{label} {name}") as loaded:
        result = common.run_wrk(wrk, proxy.url, script, 1, 1, seconds, *_script_args(name, label))
    elapsed = time.monotonic() - started
    # What the process does per second whatever the load (timers, the pool's and the feed's
    # housekeeping), counted while idle for as long: left out, or a slower run (under callgrind
    # on a busy machine) would look costlier per request.
    with _counting(proxy, work, f"{label} {name} idle") as idle:
        time.sleep(elapsed)
    return Counted(int(result["requests"]), loaded.instructions, idle.instructions)


class _Dumps:
    instructions = 0


@contextlib.contextmanager
def _counting(proxy: common.Service, work: Path, what: str) -> Iterator[_Dumps]:
    before = set(work.glob(f"{proxy.name.removeprefix('proxy-')}.*.out*"))
    counted = _Dumps()
    _control(proxy, "--zero")
    _control(proxy, "--instr=on")
    try:
        yield counted
    finally:
        _control(proxy, "--instr=off")
        _control(proxy, "--dump")
    dumped = sorted(set(work.glob(f"{proxy.name.removeprefix('proxy-')}.*.out*")) - before)
    if not dumped:
        raise RuntimeError(f"callgrind wrote no dump for {what}")
    counted.instructions = sum(_totals(path) for path in dumped)


def _script_args(name: str, label: str) -> list[str]:
    """New keys get a prefix of their own per run; replays cycle through the stored keys."""
    if name == "new":
        return [f"instructions-{label}"]
    if name == "replay":
        return ["replay", str(REPLAY_KEYS)]
    return []


def _store_replay_keys(proxy: common.Service) -> None:
    """Each key once, so that wrk's requests are replays; slow under callgrind, hence its own
    generous timeout (the first governed request translates a lot of new code)."""
    prefix, count = "replay", REPLAY_KEYS
    for number in range(count):
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=120)
        try:
            headers = {"Content-Type": "application/json", "Idempotency-Key": f"{prefix}-{number}"}
            conn.request("POST", common.PATH, body=common.BODY.encode(), headers=headers)
            status = conn.getresponse().status
        finally:
            conn.close()
        if status != 201:
            raise RuntimeError(f"storing replay key {number}: {status}")


def _control(proxy: common.Service, option: str) -> None:
    subprocess.run(
        ["callgrind_control", option, str(proxy.pid)], check=True, capture_output=True, timeout=60
    )


def _totals(path: Path) -> int:
    """The dump's instruction count: its `totals:` line (a `summary:` line may say 0)."""
    counts = [
        int(line.split()[1])
        for line in path.read_text(errors="replace").splitlines()
        if line.startswith(("totals:", "summary:"))
    ]
    return max(counts, default=0)


def _print(args: argparse.Namespace, runs: list[dict[str, dict[str, Counted]]]) -> None:
    print(f"\nInstructions per request at c=1, {args.seconds:g} s each (callgrind):\n")
    print(f"| Scenario | baseline ({args.baseline}) | working tree | ratio | ratios of the runs |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name in args.only.split(","):
        pairs = [(run["baseline"][name], run["current"][name]) for run in runs]
        if not all(before.instructions and after.instructions for before, after in pairs):
            raise RuntimeError(f"{name}: callgrind counted nothing (see its dumps)")
        ratios = [after.per_request / before.per_request for before, after in pairs]
        before = statistics.median(pair[0].per_request for pair in pairs)
        after = statistics.median(pair[1].per_request for pair in pairs)
        each = ", ".join(f"{ratio:.3f}" for ratio in ratios)
        median = statistics.median(ratios)
        print(f"| {name} | {before:,.0f} | {after:,.0f} | {median:.3f} | {each} |")


if __name__ == "__main__":
    sys.exit(main())
