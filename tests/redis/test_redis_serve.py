"""`idemproxy serve --redis URL` as a real process: the flag reaches the store it serves with."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from tests.support.backend import Ledger
from tests.support.ports import free_port
from tests.support.redisserver import RedisServer, cached_entries, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


async def _accepting(port: int, proc: asyncio.subprocess.Process) -> bool:
    assert proc.returncode is None, "the proxy exited"
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def test_serve_with_the_redis_flag_caches_replays(
    backend_url: str,
    pg_dsn: str,
    redis_server: RedisServer,
    redis_client: Redis,
    ledger: Ledger,
    tmp_path: Path,
) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "idemproxy", "serve", "--upstream", backend_url]
    argv += ["--store", pg_dsn, "--redis", redis_server.url, "--listen", f"127.0.0.1:{port}"]
    argv += ["--admin-listen", f"127.0.0.1:{free_port()}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_")}
    # The defaults (50 ms a lookup, 0.5 s a write) take a Redis that a loaded machine delays for
    # one that is down, and bypass it for a while: this test is not about that.
    env["IDEMPROXY_REDIS__TIMEOUT"] = env["IDEMPROXY_REDIS__WRITE_TIMEOUT"] = "10"
    with (tmp_path / "proxy.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        await wait_for(lambda: _accepting(port, proc), timeout=20)
        answers = []
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                url = f"http://127.0.0.1:{port}/pay"
                async with session.post(url, data=b"{}", headers={"Idempotency-Key": "k"}) as r:
                    answers.append((r.status, r.headers.get("Idempotent-Replayed"), await r.read()))
                await wait_for(lambda: _cached(redis_client))
        assert answers[0][:2] == (201, None)
        assert answers[1] == (201, "true", answers[0][2])
        assert ledger.count("k") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    output = (tmp_path / "proxy.log").read_text()
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output


async def _cached(client: Redis) -> bool:
    return await cached_entries(client) == 1
