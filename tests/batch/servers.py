"""Servers for the batch tests: the paid endpoint in-process, the real proxy as a process.

`start_proxy` runs `python -m idemproxy serve` on the embedded SQLite store, as an operator
would, and waits until it accepts connections.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.support.ports import free_port
from tests.support.processes import START_DEADLINE


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def wait_listening(port: int, process: asyncio.subprocess.Process, log: Path) -> None:
    """Until the port accepts a connection (bounded in time, not in tries: on a loaded machine
    an attempt may take far longer than its pause)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + START_DEADLINE
    while True:
        if process.returncode is not None:
            raise RuntimeError(f"proxy exited: {tail(log)}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if loop.time() >= until:
                raise RuntimeError(
                    f"proxy did not start within {START_DEADLINE}s: {tail(log)}"
                ) from None
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return


def tail(log: Path) -> str:
    return log.read_text()[-4000:]


async def start_proxy(
    upstream: str, folder: Path, env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    log = folder / "proxy.log"
    env = {**os.environ, "IDEMPROXY_ADMIN__LISTEN": "127.0.0.1:0", **(env or {})}
    with log.open("wb") as sink:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "idemproxy", "serve",
            "--listen", f"127.0.0.1:{port}",
            "--upstream", upstream,
            "--store", f"sqlite:///{folder}/idemproxy.db",
            stdout=sink, stderr=sink, env=env,
        )  # fmt: skip
    try:
        await wait_listening(port, process, log)
    except BaseException:
        await stop_process(process)  # never outlives the test that could not use it
        raise
    return process, f"http://127.0.0.1:{port}"


async def stop_process(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
    await process.wait()


def charge_items(count: int, *, path: str = "/charge", start: int = 0) -> list[dict[str, Any]]:
    return [
        {"id": f"item-{n:04d}", "method": "POST", "path": path, "body": {"amount": n + 1}}
        for n in range(start, start + count)
    ]


def write_jsonl(path: Path, objects: Iterable[Any]) -> Path:
    path.write_text("".join(json.dumps(obj) + "\n" for obj in objects))
    return path


def line_count(path: Path) -> int:
    """Complete lines in the file (a torn last line is not counted)."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def read_results(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]
