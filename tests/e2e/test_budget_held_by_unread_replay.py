"""SPEC §9: a body beyond `limits.response_buffer` waits on disk and is still stored and
answered whole, never refused. One client that does not read a large replay must not stop every
other governed response of the process.

A replay of a large stored body takes its whole size from the budget (proxy/server/replay.py,
SharedBodies) and gives it back only once the last byte is written to its client; nothing
bounds how long that takes. While it is held, a new response that does not fit goes to disk and
waits in `ResponseBudget.take` for room, and once anything waits, `try_take` refuses every other
response too, so even a 10-byte answer queues behind it: the upstream has executed, the clients
get nothing, their retries are held.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from .conftest import StartProxy

pytestmark = pytest.mark.slow

BUDGET = 8 * 1024 * 1024
LARGE = 7_800_000


@pytest.fixture
async def sized_backend() -> AsyncIterator[tuple[str, dict[str, int]]]:
    ledger: dict[str, int] = {}

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        key = request.headers.get("Idempotency-Key", "")
        ledger[key] = ledger.get(key, 0) + 1
        return web.Response(body=b"x" * int(request.query["size"]))

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", ledger
    finally:
        await runner.cleanup()


async def _send(port: int, key: str, size: int, *, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    head = (
        f"POST /r?size={size} HTTP/1.1\r\nHost: p\r\nIdempotency-Key: {key}\r\n"
        "Content-Length: 0\r\n\r\n"
    )
    await loop.sock_sendall(sock, head.encode())
    return sock


async def _read(sock: socket.socket, want: int, timeout: float) -> bytes:
    loop, got = asyncio.get_running_loop(), b""
    try:
        async with asyncio.timeout(timeout):
            while len(got) < want:
                chunk = await loop.sock_recv(sock, 1 << 20)
                if not chunk:
                    break
                got += chunk
    except TimeoutError:
        pass
    return got


async def test_an_unread_replay_does_not_stop_other_responses(
    start_proxy: StartProxy, sized_backend: tuple[str, dict[str, int]], tmp_path: Path
) -> None:
    url, ledger = sized_backend
    proxy = await start_proxy(
        "--upstream",
        url,
        "--store",
        f"sqlite:///{tmp_path / 'jobs.db'}",
        "--max-stored-body",
        str(16 * 1024 * 1024),
        env={"IDEMPROXY_LIMITS__RESPONSE_BUFFER": str(BUDGET)},
    )
    first = await _send(proxy.port, "large", LARGE)
    assert len(await _read(first, LARGE + 200, 10)) > LARGE
    first.close()
    # The duplicate's replay, never read by its client.
    unread = await _send(proxy.port, "large", LARGE, rcvbuf=4096)
    await asyncio.sleep(1.0)
    others = [
        await _send(proxy.port, "medium", 1_000_000),
        await _send(proxy.port, "small", 10),
    ]
    try:
        answers = await asyncio.gather(*(_read(s, 200, 5.0) for s in others))
        assert ledger.get("medium") == 1 and ledger.get("small") == 1  # both executed
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers
    finally:
        unread.close()
        for sock in others:
            sock.close()


async def test_a_drain_does_not_turn_an_answered_request_into_an_unknown_one(
    start_proxy: StartProxy, sized_backend: tuple[str, dict[str, int]], tmp_path: Path
) -> None:
    """The upstream answered in full (the body waits on disk for budget room); a graceful
    shutdown's deadline then cuts the attempt off as `unknown` and its client gets
    `504 upstream-timeout` ("shut down before the upstream answered"), every retry
    `409 outcome-unknown`, although the result was there to store."""
    url, ledger = sized_backend
    proxy = await start_proxy(
        "--upstream",
        url,
        "--store",
        f"sqlite:///{tmp_path / 'jobs.db'}",
        "--max-stored-body",
        str(16 * 1024 * 1024),
        env={
            "IDEMPROXY_LIMITS__RESPONSE_BUFFER": str(BUDGET),
            "IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": "2",
        },
    )
    first = await _send(proxy.port, "large", LARGE)
    assert len(await _read(first, LARGE + 200, 10)) > LARGE
    first.close()
    unread = await _send(proxy.port, "large", LARGE, rcvbuf=4096)
    await asyncio.sleep(1.0)
    victim = await _send(proxy.port, "answered", 1_000_000)
    await asyncio.sleep(1.0)
    assert ledger.get("answered") == 1
    os.kill(proxy.pid, signal.SIGTERM)
    try:
        answer = await _read(victim, 200, 8.0)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        unread.close()
        victim.close()


async def test_a_drain_during_the_wait_for_budget_room_stores_the_answer(
    start_proxy: StartProxy, sized_backend: tuple[str, dict[str, int]], tmp_path: Path
) -> None:
    """The drain's deadline falls while the answered body still waits for room (a wait longer
    than the drain): the cancellation ends the wait, not the store write."""
    url, ledger = sized_backend
    proxy = await start_proxy(
        "--upstream",
        url,
        "--store",
        f"sqlite:///{tmp_path / 'jobs.db'}",
        "--max-stored-body",
        str(16 * 1024 * 1024),
        env={
            "IDEMPROXY_LIMITS__RESPONSE_BUFFER": str(BUDGET),
            "IDEMPROXY_LIMITS__RESPONSE_BUFFER_WAIT": "30",
            "IDEMPROXY_LIMITS__RESPONSE_BUFFER_HOLD": "30",
            "IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": "1",
        },
    )
    first = await _send(proxy.port, "large", LARGE)
    assert len(await _read(first, LARGE + 200, 10)) > LARGE
    first.close()
    unread = await _send(proxy.port, "large", LARGE, rcvbuf=4096)
    await asyncio.sleep(1.0)
    victim = await _send(proxy.port, "answered", 1_000_000)
    await asyncio.sleep(0.5)
    assert ledger.get("answered") == 1
    os.kill(proxy.pid, signal.SIGTERM)
    try:
        answer = await _read(victim, 200, 8.0)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        unread.close()
        victim.close()
