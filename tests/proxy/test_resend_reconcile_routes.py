"""SPEC §3.6: an `unknown` job resolves itself only as the route its request took declares, and
is asked about only at an endpoint that vouches for its attempt's upstream; on SQLite and
PostgreSQL. Every backend counts executions per key: each test's point is that one stays one.

* A retry resends or asks on the route it took, never on another route of its path.
* The background matches a job to routes as requests are routed (longest prefix over every
  route, declared or not); where routes for different hosts may have taken it and declare
  differently, it does not ask.
* An attempt that failed over to a fallback of another origin is never asked about at the
  primary's endpoint, which never saw it and would say "never executed"."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from idemproxy.core.types import JobState
from idemproxy.store.base import Store
from tests.support.keyed import Keyed, keyed_backend
from tests.support.proxyapp import ProxyClient, ProxyFactory, served
from tests.support.reconciling import Payments

TIMEOUT = 0.3  # every route's upstream_timeout; a slow first execution takes `SLOW`
SLOW = 1.0
AFTER = SLOW + 0.3  # past the slow execution, and many background passes
RECONCILE = {"timeout": 0.5, "backoff": 0.05, "max_backoff": 0.2}
BACKGROUND = {"reconcile_interval": 0.05}


@dataclass
class Slow:
    """An endpoint that executes every request it gets, the first of each key after `SLOW`
    (the proxy times out first: `unknown`), and counts executions per key."""

    executions: Counter[str] = field(default_factory=Counter)
    seen: Counter[str] = field(default_factory=Counter)

    async def handle(self, request: web.Request) -> web.Response:
        key = request.headers["Idempotency-Key"]
        self.seen[key] += 1
        if self.seen[key] == 1:
            await asyncio.sleep(SLOW)
        self.executions[key] += 1
        return web.json_response({"execution": self.executions[key]}, status=201)


@asynccontextmanager
async def serving(routes: dict[str, Any]) -> AsyncIterator[str]:
    """A backend with `routes` (POST path → handler); keeps executing when the proxy hangs up."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    async with served(app) as url:
        yield url


async def post(client: ProxyClient, path: str, key: str, host: str | None = None) -> int:
    headers = {"Idempotency-Key": key, **({} if host is None else {"Host": host})}
    response = await client.post(path, json={"amount": 5}, headers=headers)
    await response.read()
    return response.status


async def stays_unknown(jobs: Store, key: str) -> None:
    await asyncio.sleep(AFTER)
    job = await jobs.get("anonymous", key)
    assert job is not None and job.state is JobState.UNKNOWN, job


async def test_a_retry_is_not_sent_again_on_a_route_that_did_not_declare_it(
    make_proxy: ProxyFactory, store_dsn: str, jobs: Store
) -> None:
    """`/` declares its upstream honours the key, `/charges` (the same upstream) does not."""
    keyed = Keyed(honours=False, delay=SLOW)
    async with keyed_backend(keyed) as backend:
        declared = {"prefix": "/", "upstream": backend, "upstream_timeout": TIMEOUT,
                    "resolve": {"upstream_honours_key": {"window": 3600}}}  # fmt: skip
        plain = {"prefix": "/charges", "upstream": backend, "upstream_timeout": TIMEOUT}
        client = await make_proxy(store=store_dsn, upstream=backend, routes=[declared, plain])
        assert await post(client, "/charges", "k1") == 504
        await stays_unknown(jobs, "k1")
        assert await post(client, "/charges", "k1") == 409  # outcome-unknown, not sent again
    assert (keyed.requests["k1"], keyed.executions["k1"]) == (1, 1)


async def test_the_background_asks_at_the_endpoint_of_the_route_the_job_took(
    make_proxy: ProxyFactory, store_dsn: str, jobs: Store
) -> None:
    """`/` names a reconcile endpoint that knows `/payments` only; `/admin` (the same upstream)
    names none: its jobs are never asked about there."""
    payments, admin = Payments(), Slow()
    handlers = {"/payments": payments.pay, "/reconcile": payments.reconcile,
                "/admin/{tail}": admin.handle}  # fmt: skip
    async with serving(handlers) as backend:
        endpoint = {"url": f"{backend}/reconcile", **RECONCILE}
        declared = {"prefix": "/", "upstream": backend, "upstream_timeout": TIMEOUT,
                    "resolve": {"reconcile": endpoint}}  # fmt: skip
        plain = {"prefix": "/admin", "upstream": backend, "upstream_timeout": TIMEOUT}
        client = await make_proxy(store=store_dsn, upstream=backend, routes=[declared, plain],
                                  sweeper=BACKGROUND)  # fmt: skip
        assert await post(client, "/admin/x", "k2") == 504
        await stays_unknown(jobs, "k2")
        assert payments.questions == []
        assert await post(client, "/admin/x", "k2") == 409
    assert admin.executions["k2"] == 1


async def test_routes_for_two_hosts_that_declare_differently_are_not_guessed_between(
    make_proxy: ProxyFactory, store_dsn: str, jobs: Store
) -> None:
    """`/` for any host names an endpoint; `/` for `admin.example` (the same upstream) names
    none. The job does not record its Host: the background cannot tell, and does not ask."""
    payments, admin = Payments(), Slow()
    handlers = {"/reconcile": payments.reconcile, "/admin/{tail}": admin.handle}
    async with serving(handlers) as backend:
        endpoint = {"url": f"{backend}/reconcile", **RECONCILE}
        declared = {"prefix": "/", "upstream": backend, "upstream_timeout": TIMEOUT,
                    "resolve": {"reconcile": endpoint}}  # fmt: skip
        plain = {"prefix": "/", "host": "admin.example", "upstream": backend,
                 "upstream_timeout": TIMEOUT}  # fmt: skip
        client = await make_proxy(store=store_dsn, upstream=backend, routes=[declared, plain],
                                  sweeper=BACKGROUND)  # fmt: skip
        assert await post(client, "/admin/x", "k3", host="admin.example") == 504
        await stays_unknown(jobs, "k3")
        assert payments.questions == []
        assert await post(client, "/admin/x", "k3", host="admin.example") == 409
    assert admin.executions["k3"] == 1


async def test_an_attempt_on_a_fallback_elsewhere_is_not_asked_about_at_the_primary(
    make_proxy: ProxyFactory, store_dsn: str, jobs: Store
) -> None:
    """The primary refuses (503: released, fail-over); the fallback, another origin, times out.
    The primary's endpoint never saw that attempt: its "never executed" would release it."""
    payments, fallback = Payments(), Slow()

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "busy"}, status=503)

    primary_handlers = {"/payments": refuse, "/reconcile": payments.reconcile}
    async with (
        serving(primary_handlers) as primary,
        serving({"/payments": fallback.handle}) as elsewhere,
    ):
        endpoint = {"url": f"{primary}/reconcile", **RECONCILE}
        route = {"prefix": "/payments", "upstream": primary, "fallbacks": [elsewhere],
                 "upstream_timeout": TIMEOUT, "resolve": {"reconcile": endpoint}}  # fmt: skip
        client = await make_proxy(store=store_dsn, upstream=primary, routes=[route],
                                  sweeper=BACKGROUND)  # fmt: skip
        assert await post(client, "/payments", "k4") == 504
        await stays_unknown(jobs, "k4")
        assert payments.questions == []
        assert await post(client, "/payments", "k4") == 409  # a retry does not ask either
        found = await jobs.get("anonymous", "k4")
        job = None if found is None else await jobs.get_by_id(found.id)
        assert job is not None
        assert [(a.upstream, a.state.value) for a in job.attempts] == [
            (primary, "failed"), (elsewhere, "unknown")
        ]  # fmt: skip
    assert payments.questions == []
    assert fallback.executions["k4"] == 1


async def test_an_upstreams_credential_never_goes_to_an_endpoint_of_another_origin(
    make_proxy: ProxyFactory, store_dsn: str, jobs: Store
) -> None:
    """The route sets a credential for its upstream; its reconcile endpoint is elsewhere (a
    service of its own that sees the upstream's ledger). That endpoint vouches for no attempt
    on the upstream: it is never asked, and never sent the upstream's credential."""
    payments = Payments(delay=SLOW)
    async with (
        serving({"/payments": payments.pay}) as backend,
        serving({"/reconcile": payments.reconcile}) as elsewhere,
    ):
        endpoint = {"url": f"{elsewhere}/reconcile", **RECONCILE}
        route = {"prefix": "/payments", "upstream": backend, "upstream_timeout": TIMEOUT,
                 "upstream_headers": {"set": {"X-Backend-Token": "s3cret"}},
                 "resolve": {"reconcile": endpoint}}  # fmt: skip
        client = await make_proxy(store=store_dsn, upstream=backend, routes=[route],
                                  sweeper=BACKGROUND)  # fmt: skip
        assert await post(client, "/payments", "k5") == 504
        await stays_unknown(jobs, "k5")
        assert await post(client, "/payments", "k5") == 409
    assert all("X-Backend-Token" not in headers for headers in payments.question_headers)
    assert payments.questions == []
    assert payments.executions["k5"] == 1
