"""Metrics at /metrics on the admin listener move for every request outcome (SPEC §13)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from idemproxy.admin.app import Readiness, create_admin_app
from idemproxy.config.settings import load_settings
from idemproxy.observe.metrics import Metrics, UnsentOutcome
from idemproxy.proxy.app import STORES, create_app
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.factory import create_store
from tests.support.backend import Ledger, backend_app

Clients = tuple[TestClient[web.Request, web.Application], TestClient[web.Request, web.Application]]


@pytest.fixture
async def clients(sqlite_dsn: str) -> AsyncIterator[Clients]:
    """The proxy and its admin listener sharing one Metrics, as `idemproxy serve` runs them."""
    async with TestServer(backend_app(Ledger())) as backend:
        settings = load_settings(
            upstream=str(backend.make_url("")).rstrip("/"),
            store=sqlite_dsn,
            max_wait=0.2,
            require_key=False,
            max_request_body=100,
            upstream_timeout=0.5,
        )
        metrics = Metrics()
        store = create_store(sqlite_dsn)
        await store.open()
        await store.migrate()
        proxy = TestClient(TestServer(create_app(settings, store=store, metrics=metrics)))
        admin = TestClient(
            TestServer(create_admin_app(settings, store, Readiness(), metrics=metrics))
        )
        async with proxy, admin:
            yield proxy, admin
        await store.close()


async def scrape(
    admin: TestClient[web.Request, web.Application],
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await admin.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(await response.text()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _by_outcome(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, outcome: str
) -> float:
    """The one series of `name` with this outcome (whatever its other labels)."""
    [value] = [
        v for (n, labels), v in samples.items() if n == name and ("outcome", outcome) in labels
    ]
    return value


def requests(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], outcome: str, **more: str
) -> float:
    """Requests of this outcome, summed over the labels not given (status class, source)."""
    wanted = {("outcome", outcome), *more.items()}
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "idemproxy_requests_total" and wanted <= set(labels)
    )


async def test_every_request_outcome_is_counted(clients: Clients) -> None:
    proxy, admin = clients
    key = {"Idempotency-Key": "k1"}
    assert (await proxy.post("/pay", data=b"a", headers=key)).status == 201  # new
    assert (await proxy.post("/pay", data=b"a", headers=key)).status == 201  # replayed
    assert (await proxy.post("/pay", data=b"b", headers=key)).status == 409  # mismatch
    assert (await proxy.get("/pay")).status == 201  # passthrough
    assert (await proxy.post("/pay", data=b"a", headers={"Idempotency-Key": ""})).status == 400
    assert (
        await proxy.post("/pay?status=504", data=b"a", headers={"Idempotency-Key": "u"})
    ).status == 504
    assert (
        await proxy.post("/pay?status=504", data=b"a", headers={"Idempotency-Key": "u"})
    ).status == 409
    samples = await scrape(admin)
    for outcome, count in [
        ("new", 2),
        ("replayed", 1),
        ("mismatch", 1),
        ("passthrough", 1),
        ("rejected", 1),
        ("unknown", 1),
        ("held", 0),
    ]:
        assert requests(samples, outcome) == count, outcome
    assert samples[("idemproxy_attempts_total", (("outcome", "succeeded"),))] == 1
    assert samples[("idemproxy_attempts_total", (("outcome", "unknown"),))] == 1
    # The status class and who answered (docs/operations.md, Metrics): an error-rate objective.
    assert requests(samples, "new", status_class="2xx", source="upstream") == 1
    assert requests(samples, "new", status_class="5xx", source="upstream") == 1  # the 504
    assert requests(samples, "unknown", status_class="4xx", source="proxy") == 1
    assert requests(samples, "rejected", status_class="4xx", source="proxy") == 1
    assert requests(samples, "mismatch", status_class="4xx", source="proxy") == 1
    assert requests(samples, "passthrough", status_class="2xx", source="upstream") == 1
    assert _by_outcome(samples, "idemproxy_upstream_seconds_count", "answered") == 2
    assert samples[("idemproxy_store_seconds_count", (("operation", "claim"),))] >= 5


async def test_held_and_in_flight_conflicts_are_counted(clients: Clients) -> None:
    proxy, admin = clients
    key = {"Idempotency-Key": "slow"}
    first = asyncio.create_task(proxy.post("/pay?delay=0.4", data=b"a", headers=key))
    await asyncio.sleep(0.1)
    conflict = await proxy.post("/pay?delay=0.4", data=b"a", headers=key)  # max_wait 0.2 s
    assert conflict.status == 409
    assert (await first).status == 201
    samples = await scrape(admin)
    assert requests(samples, "in_flight_conflict") == 1
    assert requests(samples, "held") == 0  # it was held, but answered with a conflict
    assert samples[("idemproxy_waiters", ())] == 0


async def test_waiters_gauge_counts_held_duplicates(clients: Clients) -> None:
    proxy, admin = clients
    key = {"Idempotency-Key": "gauge"}
    first = asyncio.create_task(proxy.post("/pay?delay=0.15", data=b"a", headers=key))
    await asyncio.sleep(0.05)
    held = asyncio.create_task(proxy.post("/pay?delay=0.15", data=b"a", headers=key))
    await asyncio.sleep(0.05)
    assert (await scrape(admin))[("idemproxy_waiters", ())] == 1
    assert (await first).status == 201 and (await held).status == 201
    samples = await scrape(admin)
    assert requests(samples, "held") == 1
    assert samples[("idemproxy_waiters", ())] == 0


async def test_store_errors_are_counted(clients: Clients, sqlite_dsn: str) -> None:
    proxy, admin = clients
    store = proxy.app[STORES].record
    await store.close()  # the store goes away under the proxy
    response = await proxy.post("/pay", data=b"a", headers={"Idempotency-Key": "down"})
    assert response.status == 503
    samples = await scrape(admin)
    assert requests(samples, "unavailable") == 1
    assert samples[("idemproxy_store_errors_total", (("operation", "claim"),))] == 1
    await store.open()  # for the fixture's teardown


async def test_unsent_claim_outcomes_exist_from_the_start(clients: Clients) -> None:
    """proxy/background/unsent.py: a rate over them is never "no data"."""
    samples = await scrape(clients[1])
    for outcome in UnsentOutcome:
        assert samples[("idemproxy_unsent_claims_total", (("outcome", outcome),))] == 0


def _answering_after(delay: float, name: str) -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(delay)
        return web.json_response({"from": name})

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    return app


async def test_late_results_are_counted(sqlite_dsn: str) -> None:
    """A hedged race: the slow primary's result loses the completion CAS (SPEC §3.4)."""
    metrics = Metrics()
    async with (
        TestServer(_answering_after(0.4, "primary")) as primary,
        TestServer(_answering_after(0.0, "fallback")) as fallback,
    ):
        settings = load_settings(
            upstream=str(primary.make_url("")).rstrip("/"),
            fallbacks=[str(fallback.make_url("")).rstrip("/")],
            hedge_after=0.05,
            store=sqlite_dsn,
        )
        async with TestClient(TestServer(create_app(settings, metrics=metrics))) as proxy:
            response = await proxy.post("/x", data=b"a", headers={"Idempotency-Key": "race"})
            assert (await response.json()) == {"from": "fallback"}
            for _ in range(50):  # the loser finishes in the background
                if metrics.late_results._value.get() == 1:
                    break
                await asyncio.sleep(0.02)
    assert metrics.late_results._value.get() == 1
    assert metrics.attempts.labels("discarded").value == 1
    assert metrics.attempts.labels("succeeded").value == 1


async def test_upstream_time_ends_when_the_answer_arrived_not_when_it_was_stored(
    clients: Clients,
) -> None:
    """A slow completion write is the store's time (idemproxy_store_seconds), not the
    upstream's: dashboards must not blame the upstream for the database."""
    proxy, admin = clients
    store = proxy.app[CONTEXT].store
    complete = store.complete

    async def slow_complete(*args: object, **kwargs: object) -> bool:
        await asyncio.sleep(0.3)
        return await complete(*args, **kwargs)  # type: ignore[arg-type]

    store.complete = slow_complete  # type: ignore[method-assign]
    began = asyncio.get_running_loop().time()
    response = await proxy.post("/pay", data=b"a", headers={"Idempotency-Key": "slow-store"})
    assert response.status == 201
    assert asyncio.get_running_loop().time() - began >= 0.3  # stored before it was answered
    samples = await scrape(admin)
    assert _by_outcome(samples, "idemproxy_upstream_seconds_count", "answered") == 1
    assert _by_outcome(samples, "idemproxy_upstream_seconds_sum", "answered") < 0.25


async def test_a_refusal_before_the_body_is_counted_and_logged(
    clients: Clients, caplog: pytest.LogCaptureFixture
) -> None:
    """An over-size body refused from its head (`Expect: 100-continue`, SPEC §9) and an unknown
    expectation are refusals as any other: they were answered, and neither counted nor logged."""
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    proxy, admin = clients
    port = proxy.server.port
    assert port is not None
    for expect, status in ((b"100-continue", b"413"), (b"tea", b"417")):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /pay HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: big\r\n"
            b"Content-Length: 5000\r\nExpect: " + expect + b"\r\n\r\n"
        )
        await writer.drain()
        first = await asyncio.wait_for(reader.readuntil(b"\r\n"), 2)
        writer.close()
        assert first.startswith(b"HTTP/1.1 " + status), first
    samples = await scrape(admin)
    assert requests(samples, "rejected", status_class="4xx", source="proxy") == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "idemproxy.requests"]
    assert any("outcome=rejected status=413" in line and "route=/" in line for line in lines)
    assert any("outcome=rejected status=417" in line for line in lines), lines
