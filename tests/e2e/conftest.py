"""End-to-end fixtures: real `idemproxy` processes in front of a real backend.

* `start_proxy`, `start_backend`, `backend`: from tests/support/processes.py (re-exported).
* `run_cli(*args)`: a one-shot `idemproxy …` command, run to completion.
* `empty_pg_dsn`: a fresh PostgreSQL database with no schema at all.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest

from tests.support.loop import run_private
from tests.support.ports import free_port
from tests.support.processes import (
    START_DEADLINE,
    Backend,
    ProxyProcess,
    StartBackend,
    StartProxy,
    backend,
    child_env,
    start_backend,
    start_proxy,
)

__all__ = [
    "START_DEADLINE",
    "Backend",
    "ProxyProcess",
    "StartBackend",
    "StartProxy",
    "backend",
    "child_env",
    "free_port",
    "start_backend",
    "start_proxy",
]

CLI_DEADLINE = 30.0  # seconds for a one-shot command (migrate, demo, a failing serve)


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


RunCli = Callable[..., CliRun]


@pytest.fixture
def run_cli(tmp_path: Path) -> RunCli:
    """Run a one-shot `idemproxy …` command to completion (bounded by `timeout`)."""

    def run(
        *args: str, env: Mapping[str, str] | None = None, timeout: float = CLI_DEADLINE
    ) -> CliRun:
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "idemproxy", *args],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
            env=child_env(env),
            timeout=timeout,
            check=False,
        )
        return CliRun(
            done.returncode,
            done.stdout.decode(errors="replace"),
            done.stderr.decode(errors="replace"),
            time.monotonic() - began,
        )

    return run


@pytest.fixture
def empty_pg_dsn(pg_server_dsn: str) -> Iterator[str]:
    """A fresh PostgreSQL database with no schema at all (not cloned from the migrated template)."""
    name = f"idemproxy_test_e2e_{os.getpid()}_{secrets.token_hex(4)}"
    _admin(pg_server_dsn, f'CREATE DATABASE "{name}"')
    try:
        yield urlsplit(pg_server_dsn)._replace(path=f"/{name}").geturl()
    finally:
        _admin(pg_server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _admin(server_dsn: str, sql: str) -> None:
    async def execute() -> None:
        conn = await asyncpg.connect(server_dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    run_private(execute())
