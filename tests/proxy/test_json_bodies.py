"""A JSON body of any depth and size, on a JSON Pointer route (SPEC §4.1, §6): it gives its key,
and parsing it never holds the event loop that every other request shares (http/offload.py)."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import multiprocessing
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from idemproxy.http.offload import IN_PROCESS_BYTES
from idemproxy.identity import intent
from idemproxy.proxy.app import STORES
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient, served
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
    async with served(app) as url:
        yield url


def large_order(order_id: str, size: int = 9 * 1024 * 1024) -> bytes:
    """A plausible order of `size` bytes: many small objects (what a batch upload looks like)."""
    item = {"sku": "SKU-000000", "qty": 3, "price": 12.5, "tags": ["a", "b"], "note": "x" * 40}
    one = len(json.dumps(item)) + 2
    items = [dict(item, sku=f"SKU-{i:06d}") for i in range(size // one)]
    return json.dumps({"order_id": order_id, "items": items}).encode()


def many_members(order_id: str, size: int = 9 * 1024 * 1024) -> bytes:
    """One flat object of about 700,000 small members (the issue's defect 2, as measured): the C
    parser reads it in one call, which lets no other thread of the process run until it ends."""
    members = b",".join(b'"m%07d":1' % n for n in range(size // 13))
    return b'{"order_id":"%s",%s}' % (order_id.encode(), members)


BODIES = {"items": large_order, "members": many_members}


async def stored_fingerprint(client: ProxyClient, key: str) -> str:
    [job] = [job for job in await client.app[STORES].record.list_jobs() if job.key == key]
    return job.fingerprint


async def pass_through_latencies(
    client: ProxyClient, until: asyncio.Future[Any], *, limit: int = 10_000
) -> list[float]:
    latencies: list[float] = []
    while not until.done() and len(latencies) < limit:
        started = time.perf_counter()
        async with client.get("/ping") as response:
            await response.read()
            assert response.status == 201
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.005)
    return latencies


@pytest.mark.parametrize("shape", list(BODIES))
async def test_a_large_json_body_is_parsed_off_the_event_loop(
    make_proxy: ProxyFactory, sqlite_dsn: str, quiet_upstream: str, shape: str
) -> None:
    """The issue's defect 2: a 9 MiB JSON body on a pointer route held the loop for about 2 s
    (its key, then its canonical form), and every other client of the process with it; on a
    worker thread, a flat object of 700,000 members still held it for about 1.2 s."""
    client = await orders(
        lambda **kw: make_proxy(store=sqlite_dsn, **kw),
        quiet_upstream,  # one store is enough
    )
    bodies = [BODIES[shape](f"big-{n}") for n in range(2)]

    async def upload() -> None:
        for body in bodies:
            assert await post(client, body) == (201, False)

    uploading = asyncio.create_task(upload())
    latencies = await pass_through_latencies(client, uploading)
    await uploading
    # Held for the parse, the loop answered nothing for 1.2 to 3 s. The parse now runs in a
    # worker process (http/offload.py): a pass-through request waits only for the loop's own
    # share of the uploads (reading, hashing and forwarding 9 MiB), and for the machine (at
    # worst about half a second, on a 2-core machine running four times slower than idle).
    # The next test measures the 99th percentile.
    assert len(latencies) >= 20, latencies
    assert statistics.median(latencies) < 0.05, latencies
    assert max(latencies) < 1.0, latencies
    # SPEC §6: the canonical fingerprint, whichever process computed it.
    head = ("POST", "/orders", "", JSON["Content-Type"], "", None)
    for n, body in enumerate(bodies):
        assert await stored_fingerprint(client, f"big-{n}") == intent.fingerprint(head, body)


async def test_a_pass_through_request_is_answered_within_50_ms_during_large_uploads(
    make_proxy: ProxyFactory, sqlite_dsn: str, quiet_upstream: str
) -> None:
    """The issue's defect 2, as it asks: several 700,000-member uploads at once, and a pass-
    through request meanwhile answered within 50 ms (the 99th percentile of a bounded loop)."""
    client = await orders(lambda **kw: make_proxy(store=sqlite_dsn, **kw), quiet_upstream)
    bodies = [many_members(f"many-{n}") for n in range(3)]
    uploads = asyncio.gather(*(post(client, body) for body in bodies))
    latencies = await pass_through_latencies(client, uploads, limit=2_000)
    assert await uploads == [(201, False)] * len(bodies)
    assert len(latencies) >= 50, latencies
    p99 = sorted(latencies)[int(0.99 * (len(latencies) - 1))]
    assert p99 < 0.05, (p99, sorted(latencies)[-10:])


@pytest.mark.parametrize(("processes", "started"), [(0, False), (1, True)])
async def test_parse_processes_say_where_a_large_body_is_parsed(
    make_proxy: ProxyFactory, sqlite_dsn: str, quiet_upstream: str, processes: int, started: bool
) -> None:
    """`server.parse_processes: 0`: on a thread of this process, as before there were any."""
    server = {"parse_processes": processes}
    client = await orders(
        lambda **kw: make_proxy(store=sqlite_dsn, server=server, **kw), quiet_upstream
    )
    assert multiprocessing.active_children() == []
    body = large_order("mid", size=IN_PROCESS_BYTES * 2)
    assert await post(client, body) == (201, False)
    assert await post(client, body) == (201, True)
    assert bool(multiprocessing.active_children()) is started


async def test_a_small_gzip_body_that_decodes_large_is_not_worked_on_the_event_loop(
    make_proxy: ProxyFactory, sqlite_dsn: str, quiet_upstream: str
) -> None:
    """A few KiB of gzip can be 9 MiB of JSON: whether its key's work leaves the loop is decided
    by what it may decode to, not by the bytes sent (a re-review held a pass-through request for
    3.7 s with three such uploads)."""
    client = await orders(lambda **kw: make_proxy(store=sqlite_dsn, **kw), quiet_upstream)
    pad = b"[" + b"0," * 4_000_000 + b"0]"  # 8 MiB of JSON, 8 KiB of gzip
    bodies = [gzip.compress(b'{"order_id":"coded-%d","pad":%s}' % (n, pad)) for n in range(3)]
    assert all(len(body) < IN_PROCESS_BYTES for body in bodies)

    async def post_coded(body: bytes) -> tuple[int, bool]:
        headers = {**JSON, "Content-Encoding": "gzip"}
        async with client.post("/orders", data=body, headers=headers) as response:
            await response.read()
            return response.status, REPLAYED in response.headers

    uploads = asyncio.gather(*(post_coded(body) for body in bodies))
    latencies = await pass_through_latencies(client, uploads, limit=2_000)
    assert await uploads == [(201, False)] * len(bodies)
    assert len(latencies) >= 20, latencies
    p99 = sorted(latencies)[int(0.99 * (len(latencies) - 1))]
    assert p99 < 0.05, (p99, sorted(latencies)[-10:])
