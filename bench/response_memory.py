"""The proxy's resident set with many large governed responses at once (limits.response_buffer).

200 clients (`--clients`) each POST a new key at once to a backend that answers every one with
an 8 MiB body (`--size`, within the default `max_stored_body`, so each is stored); then the 200
duplicates replay them, at once. Every body is checked byte for byte (SHA-256) and the backend's
executions counted. Measured, each with a fresh proxy process (VmHWM is per process):

* `baseline`: the proxy of a git revision (`--baseline`, by default the merge base with main),
  its `src/` first on PYTHONPATH, checked out with git worktree;
* `budget off`: this tree with `limits.response_buffer` at 1 TiB (nothing is ever spooled);
* `budget on`: this tree with its default (or `--budget`).

    .venv/bin/python bench/response_memory.py            # about a minute on 2 cores
    .venv/bin/python bench/response_memory.py --baseline 9717cbb --clients 100

The store is SQLite in the run's directory (bench/results/<timestamp>/, git-ignored), a fresh
file for each proxy, removed after it; PostgreSQL is not touched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from memory import MIB, RssSampler, status_kib

_PIECE = 64 * 1024


@dataclass
class Phase:
    seconds: float
    statuses: dict[int, int]
    identical: int  # bodies whose SHA-256 is the backend's
    replayed: int
    rss_peak_mb: float
    buffer_peak_mb: float | None  # idemproxy_response_buffer_bytes at its highest, if exported


@dataclass
class Run:
    label: str
    rss_idle_mb: float
    first: Phase
    replay: Phase
    hwm_mb: float
    executions: int


def body_of(number: int, size: int) -> bytes:
    return (
        number.to_bytes(4, "big")
        + bytes(range(256)) * ((size - 4) // 256)
        + b"\0" * ((size - 4) % 256)
    )


# --- the backend: one process, answers POST /big/N with body_of(N) ------------------------------


def serve_backend(port: int, size: int) -> None:
    from aiohttp import web

    executed: list[int] = []
    shared = body_of(0, size)

    async def big(request: web.Request) -> web.Response:
        await request.read()
        number = int(request.match_info["number"])
        executed.append(number)
        return web.Response(body=number.to_bytes(4, "big") + shared[4:])

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response({"posts": len(executed)})

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/big/{number}", big)
    app.router.add_get("/_stats", stats)
    app.router.add_get("/", ok)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --- the client -----------------------------------------------------------------------------------


async def _post(
    session: aiohttp.ClientSession, url: str, number: int, digest: str
) -> tuple[int, bool, bool]:
    headers = {"Idempotency-Key": f"big-{number}", "Content-Type": "application/json"}
    async with session.post(f"{url}/big/{number}", data=b"{}", headers=headers) as response:
        hashed = hashlib.sha256()
        async for piece in response.content.iter_chunked(_PIECE):
            hashed.update(piece)
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        return response.status, hashed.hexdigest() == digest, replayed


async def _gauge(session: aiohttp.ClientSession, admin_url: str) -> float | None:
    async with session.get(f"{admin_url}/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith("idemproxy_response_buffer_bytes "):
            return float(line.split()[1])
    return None


async def _phase(url: str, admin_url: str, pid: int, clients: int, digests: list[str]) -> Phase:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        peak: float | None = None
        started = time.monotonic()
        with RssSampler(pid) as sampler:
            tasks = [
                asyncio.create_task(_post(session, url, n, digests[n])) for n in range(clients)
            ]
            while not all(task.done() for task in tasks):
                value = await _gauge(session, admin_url)
                if value is not None:
                    peak = value if peak is None else max(peak, value)
                await asyncio.sleep(0.05)
            results = [task.result() for task in tasks]
        seconds = time.monotonic() - started
    return Phase(
        seconds=seconds,
        statuses=dict(Counter(status for status, _, _ in results)),
        identical=sum(1 for _, same, _ in results if same),
        replayed=sum(1 for _, _, replayed in results if replayed),
        rss_peak_mb=sampler.peak_kib / 1024,
        buffer_peak_mb=None if peak is None else peak / MIB,
    )


def _measure(
    label: str,
    args: argparse.Namespace,
    backend: common.Service,
    work: Path,
    env: dict[str, str],
    digests: list[str],
) -> Run:
    port, admin = common.free_port(), common.free_port()
    store = work / f"{label.replace(' ', '-')}.db"
    argv = common.serve_argv(port, admin, backend.url, f"sqlite:///{store}")
    posts0 = common.counts(backend)["posts"]
    proxy = common.Service(f"proxy-{label.replace(' ', '-')}", argv, port, work, env)
    try:
        proxy.wait_ready()
        admin_url = f"http://127.0.0.1:{admin}"
        idle = status_kib(proxy.pid, "VmRSS") / 1024
        first = asyncio.run(_phase(proxy.url, admin_url, proxy.pid, args.clients, digests))
        replay = asyncio.run(_phase(proxy.url, admin_url, proxy.pid, args.clients, digests))
        hwm = status_kib(proxy.pid, "VmHWM") / 1024
    finally:
        proxy.stop()
        for path in work.glob(f"{store.name}*"):
            path.unlink()
    executions = common.counts(backend)["posts"] - posts0
    return Run(label, idle, first, replay, hwm, executions)


@contextlib.contextmanager
def _worktree(revision: str, where: Path) -> Iterator[Path]:
    git = ["git", "-C", str(common.ROOT)]
    subprocess.run([*git, "worktree", "add", "--detach", str(where), revision], check=True)
    try:
        yield where
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(where)], check=False)


def _default_baseline() -> str:
    found = subprocess.run(
        ["git", "-C", str(common.ROOT), "merge-base", "HEAD", "main"],
        capture_output=True,
        text=True,
        check=True,
    )
    return found.stdout.strip()


def _table(runs: list[Run], args: argparse.Namespace) -> str:
    lines = [
        f"{args.clients} concurrent governed POSTs, each answered with {args.size // MIB} MiB "
        "(stored), then their duplicates at once; SQLite store; peak VmRSS sampled every 20 ms.",
        "",
        "| proxy | VmHWM MB | first answers: peak RSS MB, buffer gauge peak MB, s "
        "| replays: peak RSS MB, s | identical | replayed | executions |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        gauge = "-" if run.first.buffer_peak_mb is None else f"{run.first.buffer_peak_mb:.0f}"
        lines.append(
            f"| {run.label} | {run.hwm_mb:.0f} | {run.first.rss_peak_mb:.0f}, {gauge}, "
            f"{run.first.seconds:.1f} | {run.replay.rss_peak_mb:.0f}, {run.replay.seconds:.1f} "
            f"| {run.first.identical + run.replay.identical} of {2 * args.clients} "
            f"| {run.replay.replayed} of {args.clients} | {run.executions} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--size", type=int, default=8 * MIB)
    parser.add_argument("--budget", type=int, default=None, help="limits.response_buffer")
    parser.add_argument(
        "--baseline", default=None, help="git revision (merge base with main), or none"
    )
    parser.add_argument("--backend", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend is not None:
        serve_backend(args.backend, args.size)
        return 0
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    work = common.BENCH / "results" / f"response-memory-{stamp}"
    work.mkdir(parents=True)
    digests = [hashlib.sha256(body_of(n, args.size)).hexdigest() for n in range(args.clients)]
    port = common.free_port()
    backend_argv = [sys.executable, __file__, "--backend", str(port), "--size", str(args.size)]
    backend = common.Service("backend", backend_argv, port, work)
    on = {} if args.budget is None else {"IDEMPROXY_LIMITS__RESPONSE_BUFFER": str(args.budget)}
    off = {"IDEMPROXY_LIMITS__RESPONSE_BUFFER": str(1 << 40)}
    runs: list[Run] = []
    try:
        backend.wait_ready()
        baseline = args.baseline or _default_baseline()
        if baseline != "none":
            with _worktree(baseline, work / "baseline") as source:
                env = {"PYTHONPATH": str(source / "src")}
                label = f"baseline {baseline[:7]}"
                runs.append(_measure(label, args, backend, work, env, digests))
        runs.append(_measure("budget off", args, backend, work, off, digests))
        label = f"budget {args.budget // MIB} MiB" if args.budget else "budget on (256 MiB)"
        runs.append(_measure(label, args, backend, work, on, digests))
    finally:
        backend.stop()
    table = _table(runs, args)
    (work / "results.json").write_text(json.dumps([asdict(run) for run in runs], indent=2))
    (work / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
