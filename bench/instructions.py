"""Instructions the proxy executes per request, for the working tree against another revision.

On a shared 2-core machine two runs minutes apart differ by more than most single changes
(bench/findings.md), so wall-clock A/B pairs need many repeats. Instruction counts do not
drift: the proxy runs under valgrind's callgrind, which counts every instruction it executes
whatever else the machine does. Only what happens while wrk runs at one connection is counted
(`callgrind_control` switches counting on and off around it), divided by wrk's request count.
What it does not show: system-call time, cache misses, and effects that only appear under
concurrency (c=32); confirm a change that matters there with `bench/run`.

    bench/compare                       # the working tree against HEAD
    bench/compare --baseline 324a417    # against any revision (checked out with git worktree)
    bench/compare --only replay --seconds 6

Uses the project's .venv for both (the baseline's `src/` first on PYTHONPATH), the local
PostgreSQL (`--pg-dsn`, a database of its own, created and dropped) and wrk and valgrind from
Debian's packages (installed when missing and run as root, as by bench/run).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import common
import registry
import tools

DATABASE = "idemproxy_bench_instructions"
# The names of --only, and the scenarios of bench/run whose wrk scripts they send (registry.py).
_MEASURED = {"passthrough": "passthrough", "new": "new-pg", "replay": "replay-pg"}
SCENARIOS = {name: registry.SCENARIOS[scenario].script for name, scenario in _MEASURED.items()}
REPLAY_KEYS = 64
CALLGRIND_READY_TIMEOUT = 180.0  # start-up under callgrind is about 50 times slower


@dataclass
class Counted:
    requests: int
    instructions: int

    @property
    def per_request(self) -> float:
        return self.instructions / max(self.requests, 1)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    wrk = tools.ensure_debian_tools(["wrk"])["wrk"]
    valgrind = _valgrind()
    results: dict[str, dict[str, Counted]] = {}
    with tempfile.TemporaryDirectory(prefix="idemproxy-instructions-") as scratch:
        work = Path(scratch)
        with _worktree(args.baseline, work / "baseline") as baseline:
            port = common.free_port()
            listen = ["--listen", f"127.0.0.1:{port}"]
            backend_argv = [sys.executable, str(common.BENCH / "backend.py"), *listen]
            backend = common.Service("backend", backend_argv, port, work)
            with common.running(backend):
                for label, source in (("baseline", baseline), ("current", common.ROOT)):
                    results[label] = _measure(args, wrk, valgrind, backend, source, work, label)
    _print(args, results)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="a git revision (default HEAD)")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    parser.add_argument("--seconds", type=float, default=4.0, help="counted seconds per scenario")
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


def _valgrind() -> str:
    found = tools.which("valgrind")
    if found is None:
        tools.DEBIAN_PACKAGES.setdefault("valgrind", "valgrind")
        found = tools.ensure_debian_tools(["valgrind"])["valgrind"]
    return found


@contextlib.contextmanager
def _worktree(revision: str, where: Path) -> Iterator[Path]:
    """The revision's files, checked out beside the working tree (which stays untouched)."""
    git = ["git", "-C", str(common.ROOT)]
    subprocess.run([*git, "worktree", "add", "--detach", str(where), revision], check=True)
    try:
        yield where
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(where)], check=False)


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
    before = set(work.glob(f"{label}.*.out*"))
    _control(proxy, "--zero")
    _control(proxy, "--instr=on")
    result = common.run_wrk(wrk, proxy.url, script, 1, 1, seconds, *_script_args(name, label))
    _control(proxy, "--instr=off")
    _control(proxy, "--dump")
    dumped = sorted(set(work.glob(f"{label}.*.out*")) - before)
    if not dumped:
        raise RuntimeError(f"callgrind wrote no dump for {label} {name}")
    return Counted(int(result["requests"]), sum(_totals(path) for path in dumped))


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


def _print(args: argparse.Namespace, results: dict[str, dict[str, Counted]]) -> None:
    print(f"\nInstructions per request at c=1, {args.seconds:g} s each (callgrind):\n")
    print(f"| Scenario | baseline ({args.baseline}) | working tree | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name in args.only.split(","):
        before, after = results["baseline"][name], results["current"][name]
        if not before.instructions or not after.instructions:
            raise RuntimeError(f"{name}: callgrind counted nothing (see its dumps)")
        ratio = after.per_request / before.per_request
        print(f"| {name} | {before.per_request:,.0f} | {after.per_request:,.0f} | {ratio:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
