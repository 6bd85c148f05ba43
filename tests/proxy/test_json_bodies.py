"""A JSON body of any depth and size, on a JSON Pointer route (SPEC §4.1, §6): it gives its key,
and parsing it never holds the event loop that every other request shares (http/offload.py)."""

from __future__ import annotations

import asyncio
import io
import json
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from idemproxy.identity import fingerprint, key_source
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient, Server
from tests.support.proxychecks import REPLAYED, assert_problem

from .conftest import ProxyFactory

JSON = {"Content-Type": "application/json"}
DEPTH = 10_000


async def orders(proxy: ProxyFactory, upstream: str, **route: Any) -> ProxyClient:
    key = {"pointer": "/order_id"}
    return await proxy(
        routes=[
            {"prefix": "/orders", "upstream": upstream, "key": key, **route},
            {"prefix": "/ping", "upstream": upstream},
        ]
    )


async def post(client: ProxyClient, body: bytes) -> tuple[int, bool]:
    # A large body from a file-like object: aiohttp warns that bytes would be sent in one write.
    async with client.post("/orders", data=io.BytesIO(body), headers=JSON) as response:
        await response.read()
        return response.status, REPLAYED in response.headers


async def test_a_deep_body_is_governed_by_its_key(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """The issue's defect 1: nested 10,000 levels deep, the body hid `/order_id`, and every
    retry executed again."""
    client = await orders(proxy, backend_url)
    deep = b"[" * DEPTH + b"]" * DEPTH
    body = b'{"order_id": "deep-1", "x": %s}' % deep
    assert await post(client, body) == (201, False)
    # The same JSON in another layout is the same payload (SPEC §6): a replay, never a second run.
    assert await post(client, b'{"x":%s,  "order_id":"deep-1"}' % deep) == (201, True)
    assert ledger.count() == 1
    [job] = await jobs.list_jobs()
    assert job.key == "deep-1"
    changed = b'{"order_id": "deep-1", "x": %s}' % (b"[" * DEPTH + b"1" + b"]" * DEPTH)
    async with client.post("/orders", data=changed, headers=JSON) as response:
        await assert_problem(response, "payload-mismatch", 409)
    assert ledger.count() == 1


async def test_a_deep_body_without_its_key_is_refused_when_the_key_is_required(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger
) -> None:
    client = await orders(proxy, backend_url, require_key=True)
    body = b'{"order_id": "deep-2", "x": %s}' % (b'{"a":' * DEPTH + b"1" + b"}" * DEPTH)
    assert await post(client, body) == (201, False)
    assert await post(client, body) == (201, True)
    async with client.post("/orders", data=b"[" * DEPTH + b"]" * DEPTH) as response:
        await assert_problem(response, "key-missing", 400)
    assert ledger.count() == 1


async def test_a_deep_body_over_1_mib_is_refused_before_any_claim(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """SPEC §9: read at that depth, it would cost seconds of CPU; never passed through."""
    client = await orders(proxy, backend_url)
    levels = 600_000
    body = b'{"order_id": "deep-3", "x": %s}' % (b"[" * levels + b"]" * levels)
    async with client.post("/orders", data=io.BytesIO(body), headers=JSON) as response:
        problem = await assert_problem(response, "body-too-large", 413)
    assert "deeper than about 1,000 levels" in problem["detail"]
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []


# --- a large body and the event loop -------------------------------------------------------------


@pytest.fixture
async def quiet_upstream() -> AsyncIterator[str]:
    """An upstream that reads the body and answers `{}`: nothing of its own on the shared loop
    (the recording backend echoes every body back, a 9 MiB `json.dumps`)."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({}, status=201)

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", answer)
    server = Server(app)
    await server.start_server()
    try:
        yield f"http://{server.host}:{server.port}"
    finally:
        await server.close()


def large_order(order_id: str, size: int = 9 * 1024 * 1024) -> bytes:
    """A plausible order of `size` bytes: many small objects (what a batch upload looks like)."""
    item = {"sku": "SKU-000000", "qty": 3, "price": 12.5, "tags": ["a", "b"], "note": "x" * 40}
    one = len(json.dumps(item)) + 2
    items = [dict(item, sku=f"SKU-{i:06d}") for i in range(size // one)]
    return json.dumps({"order_id": order_id, "items": items}).encode()


def on_threads(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> set[int]:
    """The threads that called `module.name` (the key's parse, the canonical form)."""
    threads: set[int] = set()
    wrapped: Callable[..., Any] = getattr(module, name)

    def spy(*args: Any) -> Any:
        threads.add(threading.get_ident())
        return wrapped(*args)

    monkeypatch.setattr(module, name, spy)
    return threads


async def pass_through_latencies(client: ProxyClient, until: asyncio.Task[Any]) -> list[float]:
    latencies: list[float] = []
    while not until.done():
        started = time.perf_counter()
        async with client.get("/ping") as response:
            await response.read()
            assert response.status == 201
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.005)
    return latencies


async def test_a_large_json_body_is_parsed_off_the_event_loop(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    quiet_upstream: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue's defect 2: a 9 MiB JSON body on a pointer route held the loop for about 2 s
    (its key, then its canonical form), and every other client of the process with it."""
    key_threads = on_threads(monkeypatch, key_source, "_document")
    canonical_threads = on_threads(monkeypatch, fingerprint, "canonical_json")
    client = await orders(
        lambda **kw: make_proxy(store=sqlite_dsn, **kw),
        quiet_upstream,  # one store is enough
    )
    bodies = [large_order(f"big-{n}") for n in range(2)]

    async def upload() -> None:
        for body in bodies:
            assert await post(client, body) == (201, False)

    uploading = asyncio.create_task(upload())
    latencies = await pass_through_latencies(client, uploading)
    await uploading
    loop_thread = threading.get_ident()
    assert key_threads and loop_thread not in key_threads
    assert canonical_threads and loop_thread not in canonical_threads
    # Held for the parse, the loop answered nothing for 1.5 to 3 s. Now a pass-through request
    # waits at most for the worker thread's turns with the interpreter (5 ms each,
    # sys.getswitchinterval), several times as its client and upstream share this loop: about
    # 1 ms typically and 60 to 110 ms at worst on a busy 2-core machine.
    assert len(latencies) >= 20, latencies
    assert statistics.median(latencies) < 0.05, latencies
    assert max(latencies) < 0.5, latencies
