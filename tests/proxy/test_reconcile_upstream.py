"""SPEC §3.6, §10: a question to a reconcile endpoint goes the way the attempt went: with the
header edits of its route and upstream (`upstream_headers`), through the upstream's egress proxy
(and TLS settings), by the process's upstream client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from idemproxy.core.types import JobState
from idemproxy.store.base import Store
from tests.support.proxyapp import ProxyFactory
from tests.support.reconciling import Payments, payments_backend

from .test_reconcile import pay, settings, state_of
from .upstream_leg import ConnectProxy


@pytest.fixture
def payments() -> Payments:
    return Payments()


@pytest.fixture
async def backend(payments: Payments) -> AsyncIterator[str]:
    async with payments_backend(payments) as url:
        yield url


async def test_the_question_carries_the_routes_headers_through_its_egress_proxy(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, payments: Payments, jobs: Store
) -> None:
    payments.delay = 1.0
    configured = settings(backend, store_dsn)
    route = configured["routes"][0]
    route["upstream_headers"] = {"set": {"X-Backend-Token": "s3cret"}, "remove": ["X-Trace"]}
    async with ConnectProxy() as egress:
        configured["upstreams"] = {backend: {"proxy": egress.url}}
        client = await make_proxy(**configured)
        status, _ = await pay(client, "k1")
        assert status == 504  # unknown: the reconciler asks
        job = await state_of(jobs, "k1", JobState.COMPLETED)
        assert job.resolution == "reconcile"
    headers = payments.question_headers[-1]
    assert headers["X-Backend-Token"] == "s3cret"
    assert (headers["Idempotency-Job"], headers["Idempotency-Attempt"]) == (job.id, "1")
    # The attempt's tunnel, cut off by its timeout, and the questions' after it: every byte to
    # the backend went through the egress proxy.
    authority = backend.removeprefix("http://")
    assert egress.tunnels >= 2
    assert all(head.startswith(f"CONNECT {authority} ".encode()) for head in egress.heads)
