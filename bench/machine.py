"""Facts about the machine and the run, for the head of the report (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import os
import platform
import sqlite3
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import nginx
import tools
from common import ROOT, pg, pg_admin_db


def command_output(argv: Sequence[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def cpu_model() -> str:
    for line in command_output(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_total() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    return "unknown"


def git_revision() -> str:
    commit = command_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = command_output(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"])
    return f"{commit} with uncommitted changes in src/" if dirty else commit


def other_processes(limit: int = 5) -> list[str]:
    """The busiest processes that are not ours, for the record of a machine that was not idle."""
    listing = command_output(["ps", "-eo", "pid=,pcpu=,args=", "--sort=-pcpu"])
    mine = {os.getpid()}
    found: list[str] = []
    for line in listing.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 3 or int(parts[0]) in mine or float(parts[1]) < 5.0:
            continue
        found.append(f"{parts[2][:70]} ({parts[1]} %)")
        if len(found) == limit:
            break
    return found


def peer_versions(bench_python: Path) -> str:
    names = ("asgi-idempotency-header", "starlette", "uvicorn", "redis")
    code = f"import importlib.metadata as m;print(' / '.join(m.version(n) for n in {names!r}))"
    return command_output([str(bench_python), "-c", code]) or "unknown"


def facts(args: argparse.Namespace, found: dict[str, str], bench_python: Path) -> dict[str, str]:
    admin = pg_admin_db(args.pg_dsn)
    pg_version = pg(args.pg_dsn, "SHOW server_version", database=admin)[0][0]
    sync = pg(args.pg_dsn, "SHOW synchronous_commit", database=admin)[0][0]
    buffers = pg(args.pg_dsn, "SHOW shared_buffers", database=admin)[0][0]
    redis = tools.version([found["redis-server"], "--version"]).split(" sha=")[0]
    nginx_version = tools.version([found["nginx"], "-v"]).rpartition("/")[2]
    return {
        "CPU": f"{cpu_model()}, {command_output(['nproc']) or os.cpu_count()} cores (nproc)",
        "Memory": memory_total(),
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "aiohttp / uvloop": f"{metadata.version('aiohttp')} / {metadata.version('uvloop')}",
        "asyncpg / SQLite": f"{metadata.version('asyncpg')} / {sqlite3.sqlite_version}",
        "PostgreSQL": (
            f"{pg_version.split()[0]} on 127.0.0.1, synchronous_commit={sync}, "
            f"shared_buffers={buffers}"
        ),
        "SQLite": f"{sqlite3.sqlite_version}, a file on local disk (WAL, synchronous=FULL)",
        "Redis": redis.removeprefix("Redis server ").removeprefix("v="),
        "nginx": f"{nginx_version}; {nginx.describe()}",
        "pgbench": tools.version([found["pgbench"], "--version"]),
        "peer": (
            "asgi-idempotency-header / starlette / uvicorn / redis-py "
            f"{peer_versions(bench_python)}, one uvicorn process (uvloop, httptools)"
        ),
        "wrk": tools.version([found["wrk"], "-v"]).split(" [", 1)[0].removeprefix("wrk "),
        "idemproxy": f"{metadata.version('idemproxy')}, commit {git_revision()}",
    }
