"""How many of the proxy's own Python calls one POST with a new key runs, in how many files.

    bench/calls.py                      # PostgreSQL (a database of its own, created and dropped)
    bench/calls.py --store sqlite       # a SQLite file in a scratch directory
    bench/calls.py --json               # the numbers and the table as one JSON document

Starts the benchmark's backend (backend.py) and `idemproxy serve` in front of it, the proxy
under a profile hook (call_hook.py, which runs the proxy's own `main`). After warm-up requests
(imports on first use, prepared statements, the upstream connection), it sends POSTs with new
keys on one kept-alive connection, one at a time, and records each one's calls from just before
it is sent until a short settle after its answer is read. What is counted:

* a call: a function (or comprehension, or module body) defined under the `idemproxy`
  package's directory starts running, in any thread of the proxy; each frame once, so a
  coroutine resumed after an `await` is not a new call;
* files: the distinct source files those calls are in;
* re-entries: calls into a file already entered earlier in the request, made from another file
  (from the proxy's own code, a library or the event loop); calls within a file are not
  re-entries.

It prints the three numbers for each counted request (they differ only when a timer of the
proxy fires during one), then a per-file table of the request with the fewest calls. The
PostgreSQL server is `--pg-dsn` (an administrative DSN, default BENCH_PG_DSN, else
IDEMPROXY_TEST_POSTGRES, else the local server), used only to create and drop its own database.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import common
from call_hook import PACKAGE, Call

DATABASE = f"idemproxy_bench_calls_{os.getpid()}"
_LOCAL_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
_CONTROL_TIMEOUT = 30.0


@dataclass(frozen=True)
class FileCalls:
    file: str  # relative to the package's directory
    calls: int
    entries: int  # calls made from another file (the first of them included)
    reentries: int


@dataclass(frozen=True)
class Counted:
    calls: int
    files: int
    reentries: int
    per_file: list[FileCalls]
    sequence: list[str]  # "file:function <- caller's file", in order


def count(
    calls: Sequence[Call], package: str = PACKAGE, as_one: Mapping[str, str] | None = None
) -> Counted:
    """The three numbers and the per-file table of one request's calls, in the order they
    started. A file is entered by its first call, whoever makes it; a later call into it from
    another file is a re-entry. `as_one` maps files (relative to the package) to the file they
    would be part of: the same calls counted as if those files were one."""
    per_file: Counter[str] = Counter()
    entries: Counter[str] = Counter()
    reentries: Counter[str] = Counter()
    for callee, _name, caller in _merged(calls, package, as_one or {}):
        if caller != callee:
            entries[callee] += 1
            if callee in per_file:
                reentries[callee] += 1
        per_file[callee] += 1
    table = [
        FileCalls(
            file=path.removeprefix(package),
            calls=n,
            entries=entries[path],
            reentries=reentries[path],
        )
        for path, n in per_file.items()
    ]
    table.sort(key=lambda row: (-row.calls, row.file))
    return Counted(
        calls=len(calls),
        files=len(per_file),
        reentries=sum(reentries.values()),
        per_file=table,
        sequence=[_shown(call, package) for call in calls],
    )


def _merged(calls: Sequence[Call], package: str, as_one: Mapping[str, str]) -> list[Call]:
    def file(path: str) -> str:
        relative = path.removeprefix(package)
        return (
            package + as_one[relative] if path.startswith(package) and relative in as_one else path
        )

    if not as_one:
        return list(calls)
    return [
        (file(callee), name, None if caller is None else file(caller))
        for callee, name, caller in calls
    ]


def _as_one(specs: Sequence[str]) -> dict[str, str]:
    """`--as-one INTO=FILE,FILE`: each FILE counted as part of INTO."""
    merged: dict[str, str] = {}
    for spec in specs:
        into, _, files = spec.partition("=")
        if not into or not files:
            raise SystemExit(f"bench/calls.py: --as-one {spec!r}: expected INTO=FILE[,FILE...]")
        merged.update({part: into for part in files.split(",") if part})
    return merged


def _shown(call: Call, package: str) -> str:
    callee, name, caller = call
    return f"{callee.removeprefix(package)}:{name} <- {_caller(caller, package)}"


def _caller(path: str | None, package: str) -> str:
    """The caller's file: in the package, relative to it; outside, the library's own path
    (`aiohttp/web_protocol.py`, `asyncio/runners.py`: a callback of the event loop)."""
    if path is None:
        return "-"
    if path.startswith(package):
        return path.removeprefix(package)
    return "/".join(Path(path).parts[-2:])


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    with tempfile.TemporaryDirectory(prefix="idemproxy-calls-") as scratch:
        work = Path(scratch)
        with (
            _store(args, work) as store,
            _backend(work) as backend,
            _proxy(work, backend, store, args.source) as (proxy, control),
        ):
            counted = _measure(proxy, control, args)
    _print(counted, args)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/calls.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("postgres", "sqlite"), default="postgres")
    default_dsn = os.environ.get("BENCH_PG_DSN") or os.environ.get("IDEMPROXY_TEST_POSTGRES")
    parser.add_argument(
        "--pg-dsn",
        default=default_dsn or _LOCAL_PG,
        help=f"an administrative DSN, used only to create and drop {DATABASE}",
    )
    parser.add_argument("--warmup", type=int, default=50, help="uncounted new keys first")
    parser.add_argument("--requests", type=int, default=5, help="counted new keys")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.05,
        help="seconds counted after each answer is read (what the proxy does after it)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        default=common.ROOT,
        help="a checkout whose src/ the proxy runs (default: this tree), to count another revision",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--sequence", action="store_true", help="also print every call of that request, in order"
    )
    parser.add_argument(
        "--as-one",
        action="append",
        default=[],
        metavar="INTO=FILE[,FILE...]",
        help="count the files (relative to the package) as part of INTO, as if they were moved "
        "there: what a merge of modules would leave (repeatable)",
    )
    return parser.parse_args(argv)


@contextlib.contextmanager
def _store(args: argparse.Namespace, work: Path) -> Iterator[str]:
    if args.store == "sqlite":
        yield f"sqlite:///{work / 'calls.db'}"
        return
    common.recreate_db(args.pg_dsn, DATABASE)
    try:
        yield common.pg_dsn(args.pg_dsn, DATABASE)
    finally:
        common.drop_db(args.pg_dsn, DATABASE)


@contextlib.contextmanager
def _backend(work: Path) -> Iterator[common.Service]:
    port = common.free_port()
    argv = [sys.executable, str(common.BENCH / "backend.py"), "--listen", f"127.0.0.1:{port}"]
    with common.running(common.Service("backend", argv, port, work)) as backend:
        yield backend


@contextlib.contextmanager
def _proxy(
    work: Path, backend: common.Service, store: str, source: Path
) -> Iterator[tuple[common.Service, socket.socket]]:
    port, admin = common.free_port(), common.free_port()
    control_path = str(work / "control.sock")
    argv = [
        sys.executable,
        str(common.BENCH / "call_hook.py"),
        control_path,
        "serve",
        "--listen",
        f"127.0.0.1:{port}",
        "--upstream",
        backend.url,
        "--store",
        store,
        "--admin-listen",
        f"127.0.0.1:{admin}",
    ]
    env = {"PYTHONPATH": str(source / "src")}
    with (
        common.running(common.Service("proxy", argv, port, work, env)) as proxy,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control,
    ):
        control.settimeout(_CONTROL_TIMEOUT)
        control.connect(control_path)
        yield proxy, control


def _measure(
    proxy: common.Service, control: socket.socket, args: argparse.Namespace
) -> list[Counted]:
    stream = control.makefile("rw", encoding="utf-8")
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        for number in range(args.warmup):
            _post(conn, f"calls-warm-{number}")
        counted = []
        for number in range(args.requests):
            _command(stream, "start")
            _post(conn, f"calls-counted-{number}")
            time.sleep(args.settle)
            calls = [tuple(call) for call in json.loads(_command(stream, "stop"))]
            package = str((args.source / "src" / "idemproxy").resolve()) + os.sep
            counted.append(count(calls, package, _as_one(args.as_one)))  # type: ignore[arg-type]
        return counted
    finally:
        conn.close()
        stream.close()


def _post(conn: http.client.HTTPConnection, key: str) -> None:
    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
    conn.request("POST", common.PATH, body=common.BODY.encode(), headers=headers)
    response = conn.getresponse()
    response.read()
    if response.status != 201:
        raise RuntimeError(f"POST with key {key}: {response.status}, expected the backend's 201")


def _command(stream: TextIO, command: str) -> str:
    stream.write(command + "\n")
    stream.flush()
    answer: str = stream.readline()
    if not answer:
        raise RuntimeError(f"the proxy's call hook closed the control socket at {command!r}")
    return answer


def _print(counted: list[Counted], args: argparse.Namespace) -> None:
    fewest = min(counted, key=lambda one: one.calls)
    if args.json:
        document = {
            "store": args.store,
            "requests": [
                {"calls": one.calls, "files": one.files, "reentries": one.reentries}
                for one in counted
            ],
            "fewest": asdict(fewest),
        }
        print(json.dumps(document, indent=2))
        return
    print(f"One POST with a new key ({args.store}), the proxy's own calls:")
    for number, one in enumerate(counted, 1):
        print(
            f"  request {number}: {one.calls} calls, {one.files} files, {one.reentries} re-entries"
        )
    print(f"\nPer file (request with the fewest calls: {fewest.calls}):")
    print(f"  {'file':<40} {'calls':>6} {'entries':>8} {'re-entries':>11}")
    for row in fewest.per_file:
        print(f"  {row.file:<40} {row.calls:>6} {row.entries:>8} {row.reentries:>11}")
    if args.sequence:
        print("\nEvery call of that request, in order (function <- the caller's file):")
        for line in fewest.sequence:
            print(f"  {line}")


if __name__ == "__main__":
    raise SystemExit(main())
