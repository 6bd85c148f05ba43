"""A reader of stderr that stops reading must not stop the proxy (idemproxy/observe/logs.py).

A real `idemproxy serve` process logs every governed request to a pipe that nobody reads until
the end: far more than the pipe holds (64 KiB on Linux). Written in place, the first write past
that would block the event loop and every request after it would hang.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from .conftest import Backend, child_env, free_port

pytestmark = pytest.mark.slow

REQUESTS = 1500  # about 250 KB of request lines: four times what a pipe holds


def _spawn(command: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,  # read only at the end
        cwd=cwd,
        env=child_env(),
    )


async def _until_accepting(port: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(400):
        assert proc.poll() is None, "the proxy exited at start"
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise AssertionError("the proxy never accepted a connection")


async def test_a_stalled_stderr_reader_does_not_stall_requests(
    backend: Backend, tmp_path: Path
) -> None:
    port, admin = free_port(), free_port()
    command = [sys.executable, "-m", "idemproxy", "serve", "--upstream", backend.url]
    command += ["--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"]
    command += ["--store", f"sqlite:///{tmp_path}/idemproxy.db"]
    proc = _spawn(command, tmp_path)
    try:
        await _until_accepting(port, proc)
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for number in range(REQUESTS):
                headers = {"Idempotency-Key": f"log-{number}"}
                async with session.post(
                    f"http://127.0.0.1:{port}/pay", data=b"x", headers=headers
                ) as response:
                    assert response.status == 201, await response.text()
            async with session.get(f"http://127.0.0.1:{admin}/metrics") as response:
                metrics = await response.text()
        assert "idemproxy_log_lines_dropped_total 0.0" in metrics
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-2000:]
    lines = stderr.decode(errors="replace").splitlines()
    logged = [line for line in lines if "idemproxy.requests" in line]
    assert len(logged) == REQUESTS  # every line arrived, once the pipe was read again
    assert backend.ledger.count() == REQUESTS
