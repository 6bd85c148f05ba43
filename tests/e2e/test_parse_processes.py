"""`idemproxy serve` and its body parsing processes (http/offload.py, `server.parse_processes`):
started with the first large JSON body, and gone when the proxy is: stopped by its shutdown on
SIGTERM, and exiting by themselves when it is killed without one (SIGKILL)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from idemproxy.http.offload import IN_PROCESS_BYTES

if TYPE_CHECKING:
    from .conftest import Backend, ProxyProcess, StartProxy

pytestmark = pytest.mark.slow

# A governed JSON body the proxy canonicalises (under server.spool_threshold), in a process.
BODY = json.dumps({"lines": ["x" * 100] * (2 * IN_PROCESS_BYTES // 100)}).encode()


def children(pid: int) -> set[int]:
    """The live (not zombie) processes whose parent is `pid` (Linux: /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent = stat.read_text().rpartition(")")[2].split()[:2]
        except OSError:  # gone meanwhile
            continue
        if int(parent) == pid and state != "Z":
            found.add(int(stat.parent.name))
    return found


def alive(pids: set[int]) -> set[int]:
    living = set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[0] != "Z":
            living.add(pid)
    return living


async def until_gone(pids: set[int], deadline: float = 10.0) -> set[int]:
    until = time.monotonic() + deadline
    while living := alive(pids):
        if time.monotonic() >= until:
            return living
        await asyncio.sleep(0.05)
    return set()


async def parsing_proxy(start_proxy: StartProxy, backend: Backend, tmp_path: Path) -> ProxyProcess:
    proxy = await start_proxy("--upstream", backend.url, "--store", f"sqlite:///{tmp_path}/db")
    assert children(proxy.pid) == set()  # none before the first large body
    headers = {"Idempotency-Key": "large", "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/charges", data=BODY, headers=headers) as response,
    ):
        assert response.status == 201, await response.text()
    return proxy


async def test_sigterm_stops_the_parse_processes(
    backend: Backend, start_proxy: StartProxy, tmp_path: Path
) -> None:
    proxy = await parsing_proxy(start_proxy, backend, tmp_path)
    workers = children(proxy.pid)
    # One body: one worker process started, and multiprocessing's resource tracker (spawn).
    assert 1 <= len(workers) <= 2, workers
    assert await proxy.terminate() == 0, proxy.describe()
    assert await until_gone(workers, deadline=1.0) == set()


async def test_parse_processes_exit_when_the_proxy_is_killed(
    backend: Backend, start_proxy: StartProxy, tmp_path: Path
) -> None:
    proxy = await parsing_proxy(start_proxy, backend, tmp_path)
    workers = children(proxy.pid)
    assert workers
    proxy.kill()  # SIGKILL: no shutdown runs
    assert await until_gone(workers) == set()
