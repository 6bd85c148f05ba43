"""No request leaves the proxy's objects in a reference cycle.

What reference counting cannot free waits for the cyclic collector, whose every pass walks all
of it while the event loop does nothing else: a cycle per request cost pass-through about 5 µs
of collector time per request at c=32 (docs/benchmarks.md). The proxy runs as `idemproxy serve`
runs it (AppRunner + GuardedSite) on a real socket; every kind of request goes through it on
connections kept alive and on connections closed after one request, and the collector, told to
keep what it finds, must find nothing of the proxy's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator

from .conftest import ListeningProxy


def request(path: str, key: str | None, *, close: bool) -> bytes:
    body = b'{"amount":1}'
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: proxy",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    if key is not None:
        lines.append(f"Idempotency-Key: {key}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def exchange(address: tuple[str, int], *requests: bytes) -> bytes:
    """Send the requests on one connection and read until the proxy closes it."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(b"".join(requests))
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@contextlib.contextmanager
def kept_garbage() -> Iterator[list[object]]:
    """What the cyclic collector finds unreachable from here on (it keeps it to be read)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()


def the_proxys(garbage: list[object]) -> list[str]:
    names = (f"{type(o).__module__}.{type(o).__qualname__}" for o in garbage)
    return sorted({name for name in names if name.startswith(("idemproxy.", "httptools."))})


async def test_no_request_leaves_a_reference_cycle(listening_proxy: ListeningProxy) -> None:
    # Built before the count: settings and the app are made once and live as long as the proxy.
    address = await listening_proxy(server={"keepalive_timeout": 0.2})
    await exchange(address, request("/pay", "warm-up", close=True))
    with kept_garbage() as garbage:
        for close in (True, False):
            key = f"new-{close}"
            requests = [
                request("/pay", None, close=False),  # pass-through
                request("/pay", key, close=False),  # a new key
                request("/pay", key, close=False),  # its replay
            ]
            if close:  # closed by the client's last request, or else idle until the proxy's
                requests.append(request("/pay", None, close=True))  # keep-alive timeout
            answers = await exchange(address, *requests)
            assert answers.count(b"HTTP/1.1 201") == len(requests), answers
        # A duplicate held while its first request runs, a chunked answer, a released job.
        first = exchange(address, request("/pay?delay=0.3", "held", close=True))
        held = exchange(address, request("/pay?delay=0.3", "held", close=True))
        others = (
            exchange(address, request("/pay?chunked=1", "chunked", close=True)),
            exchange(address, request("/pay?status=503", "released", close=True)),
        )
        concurrent = await asyncio.gather(first, held, *others)
        assert [a.split(b"\r\n", 1)[0] for a in concurrent] == [
            b"HTTP/1.1 201 Created",
            b"HTTP/1.1 201 Created",
            b"HTTP/1.1 201 Created",
            b"HTTP/1.1 503 Service Unavailable",
        ], concurrent
        assert b"Idempotent-Replayed: true" in concurrent[1]
        await asyncio.sleep(0.5)  # the proxy's side of each connection is closed and dropped
        gc.collect()
        assert the_proxys(garbage) == []
