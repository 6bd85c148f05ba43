"""Where a request's time goes: the proxy's own metrics, and py-spy samples of its CPU.

`scrape()` reads the proxy's admin /metrics (Prometheus text); the difference of two scrapes
around a measured run gives, per request, the time spent waiting on the store (by operation)
and on the upstream, and the requests by outcome.

`record()` runs `py-spy record --format raw` against the proxy for a few seconds (a separate,
unmeasured run: sampling slows the process a little) and `summarise()` turns its collapsed
stacks into tables: CPU by component (the innermost frame's package) and the hottest functions.
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
_WORKER_LABEL = re.compile(r',?worker="\d+"')
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")


def scrape(admin_url: str) -> dict[str, float]:
    """`{"name{labels}": value}` of the idemproxy_* series on the proxy's /metrics."""
    with urllib.request.urlopen(admin_url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"].startswith("idemproxy_"):
            # --workers: each series once per worker (worker="i"); summed, as one proxy's.
            labels = _WORKER_LABEL.sub("", match["labels"] or "").strip(",")
            name = f"{match['name']}{{{labels}}}" if labels else match["name"]
            out[name] = out.get(name, 0.0) + float(match["value"])
    return out


@dataclass
class TimeSplit:
    """Per-request averages over one run, from the proxy's metrics (ms, except counts)."""

    requests: float
    outcomes: dict[str, float] = field(default_factory=dict)
    store_ms: dict[str, float] = field(default_factory=dict)  # by operation, per request
    store_calls: float = 0.0  # store calls per request
    upstream_ms: float = 0.0  # per request (all attempts)
    upstream_calls: float = 0.0
    # Group commit (idemproxy_store_batch_rows), by kind (claim, complete): statements per
    # request (each one transaction and one commit), rows per statement, and the statements
    # by rows carried ({"1": n, "2": n, "3-4": n, …}: the histogram's buckets, not cumulative).
    statements: dict[str, float] = field(default_factory=dict)
    rows_per_statement: dict[str, float] = field(default_factory=dict)
    statement_sizes: dict[str, dict[str, float]] = field(default_factory=dict)


def time_split(before: dict[str, float], after: dict[str, float]) -> TimeSplit | None:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    outcomes: dict[str, float] = {}
    for name in after:
        # Summed over the answer's other labels (status class, source: SPEC §13).
        match = re.fullmatch(r'idemproxy_requests_total\{outcome="(\w+)"[^}]*\}', name)
        if match and delta(name):
            outcomes[match[1]] = outcomes.get(match[1], 0.0) + delta(name)
    requests = sum(outcomes.values())
    if not requests:
        return None
    split = TimeSplit(requests=requests, outcomes=outcomes)
    for name in after:
        match = re.fullmatch(r'idemproxy_store_seconds_sum\{operation="(\w+)"\}', name)
        if match and delta(name):
            split.store_ms[match[1]] = 1000 * delta(name) / requests
            count = name.replace("_sum{", "_count{")
            split.store_calls += delta(count) / requests
        match = re.fullmatch(
            r'idemproxy_upstream_seconds_sum\{outcome="(\w+)",upstream="[^"]*"\}', name
        )
        if match and delta(name):
            split.upstream_ms += 1000 * delta(name) / requests
            split.upstream_calls += delta(name.replace("_sum{", "_count{")) / requests
    _batches(split, delta, list(after))
    return split


def _batches(split: TimeSplit, delta: Callable[[str], float], names: list[str]) -> None:
    for name in names:
        match = re.fullmatch(r'idemproxy_store_batch_rows_count\{kind="(\w+)"\}', name)
        if not match or not delta(name):
            continue
        kind, statements = match[1], delta(name)
        split.statements[kind] = statements / split.requests
        rows = delta(name.replace("_count{", "_sum{"))
        split.rows_per_statement[kind] = rows / statements
        bounds = []
        for other in names:
            bucket = re.fullmatch(
                r'idemproxy_store_batch_rows_bucket\{kind="' + kind + r'",le="([^"]+)"\}', other
            )
            if bucket:
                bounds.append((float(bucket[1]), delta(other)))
        bounds.sort()
        sizes: dict[str, float] = {}
        below, low = 0.0, 0.0
        for bound, cumulative in bounds:
            if cumulative - below:
                top = "more" if bound == float("inf") else f"{bound:g}"
                label = top if low + 1 >= bound or top == "more" else f"{low + 1:g}-{top}"
                sizes[f"> {low:g}" if top == "more" else label] = cumulative - below
            below, low = cumulative, bound
        split.statement_sizes[kind] = sizes


def record(py_spy: str, pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """Starts sampling `pid` for `seconds`; wait on the returned process (raw stacks in `out`)."""
    argv = [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds)))]
    argv += ["--rate", "200", "--native", "--format", "raw", "--output", str(out)]
    log = out.with_suffix(".log").open("wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


@dataclass
class Profile:
    samples: int
    # Samples whose innermost frame is a system call (libc): socket writes and reads mostly.
    # py-spy samples a thread that is runnable but waiting for a CPU as well as one running,
    # and a write to a loopback socket wakes its reader, which often takes the CPU from the
    # writer on a busy machine: this share is wall time, not CPU (/proc's system time is that).
    syscall_pct: float
    components: list[tuple[str, float]]  # (component, % of samples), innermost frame's
    # The rest is % of the samples that are not in a system call: the CPU work.
    functions: list[tuple[str, float]]  # (function, % as the innermost frame)
    inclusive: list[tuple[str, float]]  # (idemproxy function, % on the stack)


_STDLIB = frozenset(sys.stdlib_module_names)
# Native frames (py-spy --native) by their C file: whose code it is.
_NATIVE = {
    "libc.so.6": "system calls (libc)",
    "llhttp.c": "aiohttp (C)",
    "_http_parser.c": "aiohttp (C)",
    "_http_writer.c": "aiohttp (C)",
    "_websocket": "aiohttp (C)",
    "protocol.c": "asyncpg (C)",
    "pgproto.c": "asyncpg (C)",
    "recordobj.c": "asyncpg (C)",
    "loop.c": "uvloop (C)",
    "stream.c": "uvloop (C)",
    "timer.c": "uvloop (C)",
    "_helpers_c.c": "multidict / yarl / propcache (C)",
    "_multidict.c": "multidict / yarl / propcache (C)",
    "_quoting_c.c": "multidict / yarl / propcache (C)",
}


def component(func: str, path: str) -> str:
    """A frame's component: `idemproxy.<module>`, a package, or a stdlib module.

    py-spy names files relative to their sys.path entry (`aiohttp/web_protocol.py`,
    `idemproxy/proxy/handler.py`). Without native frames, time in C code (uvloop's I/O, asyncpg's
    protocol, hashing) is charged to the innermost Python frame; the event loop's own
    (`Runner.run` innermost) is shown as such.
    """
    if func == "Runner.run" and path.startswith("asyncio/runners"):
        return "event loop (uvloop, C)"
    if not path.endswith(".py") and not path.startswith("<"):  # a native frame
        name = Path(path).name
        if name in _NATIVE:
            return _NATIVE[name]
        if "python3" in name or name.endswith(".h") or name.startswith(("ceval", "Objects")):
            return "CPython interpreter"
        return f"native ({name})"
    clean = path.lstrip("/")
    if "site-packages/" in clean:
        clean = clean.split("site-packages/", 1)[1]
    if clean.startswith("idemproxy/"):
        return "idemproxy." + clean.removeprefix("idemproxy/").removesuffix(".py").replace("/", ".")
    if clean.startswith("<") or not clean:
        return clean or "?"
    top = clean.split("/", 1)[0].removesuffix(".py")
    return f"{top} (stdlib)" if top in _STDLIB else top


def _frames(stack: str) -> list[tuple[str, str]]:
    frames: list[tuple[str, str]] = []
    for raw in stack.split(";"):
        match = _FRAME.match(raw.strip())
        if match:
            frames.append((match["func"], match["file"]))
        else:
            frames.append((raw.strip(), ""))
    return frames


def summarise(raw: Path, top: int = 12) -> Profile | None:
    if not raw.exists():
        return None
    by_component: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = syscalls = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = _frames(stack)
        if not frames:
            continue
        total += count
        func, path = frames[-1]
        by_component[component(func, path)] += count
        if Path(path).name == "libc.so.6":
            syscalls += count
            continue
        by_function[f"{func} ({component(func, path)})"] += count
        seen: set[str] = set()
        for func, path in frames:
            if path.startswith("idemproxy/") or "/idemproxy/" in path:
                name = f"{component(func, path).removeprefix('idemproxy.')}.{func}"
                if name not in seen:
                    seen.add(name)
                    inclusive[name] += count
    work = total - syscalls
    if not total or not work:
        return None

    def pct(counter: Counter[str], of: int) -> list[tuple[str, float]]:
        return [(name, 100.0 * n / of) for name, n in counter.most_common(top)]

    # Frames on every stack (the entry point, the server's main coroutine) tell nothing.
    inclusive = Counter({name: n for name, n in inclusive.items() if n < work * 0.995})
    return Profile(
        samples=total,
        syscall_pct=100.0 * syscalls / total,
        components=pct(by_component, total),
        functions=pct(by_function, work),
        inclusive=pct(inclusive, work),
    )
