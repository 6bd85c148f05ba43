"""SPEC §7.1: `GET` with `Idempotency-Status: <key>` answers what became of the key, from the
store, scoped by owner, never forwarded and never a claim."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.metrics import counted
from tests.support.proxyapp import ProxyClient
from tests.support.proxychecks import KEY, assert_problem, settle_quietly, wait_for_jobs

from .conftest import ProxyFactory

STATUS = "Idempotency-Status"
ALICE = {"Authorization": "Bearer alice"}
MALLORY = {"Authorization": "Bearer mallory"}


async def lookup(client: ProxyClient, key: str, **headers: str) -> tuple[int, Any]:
    async with client.get("/payments", headers={STATUS: key, **headers}) as response:
        body = await response.read()
        return response.status, json.loads(body)


async def test_a_completed_key_answers_its_state_attempts_and_status(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(status_header=STATUS)
    async with client.post("/payments", data=b"pay", headers={KEY: "k1", **ALICE}) as response:
        assert response.status == 201
        job_id = response.headers.get("Idempotency-Job")
    async with client.get("/payments", headers={STATUS: "k1", **ALICE}) as response:
        assert response.status == 200
        assert response.headers["Cache-Control"] == "no-store"
        document = await response.json()
    [job] = await jobs.list_jobs()
    assert document == {
        "key": "k1",
        "job": job.id,
        "state": "completed",
        "attempts": 1,
        "status": 201,
    }
    assert job_id in (None, job.id)
    assert [e.method for e in ledger.executions] == ["POST"]  # the lookup never went upstream


async def test_another_owner_learns_nothing(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(status_header=STATUS)
    async with client.post("/payments", data=b"pay", headers={KEY: "k2", **ALICE}) as response:
        assert response.status == 201
    answers = []
    for key, headers in [("k2", MALLORY), ("k2", {}), ("never-used", ALICE)]:
        async with client.get("/payments", headers={STATUS: key, **headers}) as response:
            answers.append(await assert_problem(response, "key-not-found", 404))
    # The same document, but for each request's own id: which one is which is hidden.
    assert len({answer.pop("request_id") for answer in answers}) == 3
    assert answers[0] == answers[1] == answers[2]
    assert ledger.count() == 1
    assert len(await jobs.list_jobs()) == 1


async def test_an_unknown_key_creates_no_job_and_reaches_no_backend(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(status_header=STATUS)
    for _ in range(3):
        assert (await lookup(client, "k3", **ALICE))[0] == 404
    await settle_quietly()
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []
    # And the key is still free: the first request with it executes.
    async with client.post("/payments", data=b"pay", headers={KEY: "k3", **ALICE}) as response:
        assert response.status == 201
        assert "Idempotent-Replayed" not in response.headers
    assert ledger.count() == 1


async def test_a_key_in_flight_is_answered_at_once_without_a_second_execution(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(status_header=STATUS)

    async def first() -> int:
        headers = {KEY: "k4", **ALICE}
        async with client.post("/payments?delay=1", data=b"pay", headers=headers) as response:
            return response.status

    running = asyncio.create_task(first())
    await wait_for_jobs(jobs)  # claimed; the backend sleeps a second before it executes
    status, document = await lookup(client, "k4", **ALICE)
    assert (status, document["state"], document["attempts"]) == (200, "in_flight", 1)
    assert "status" not in document
    assert await running == 201
    status, document = await lookup(client, "k4", **ALICE)
    assert (document["state"], document["status"]) == ("completed", 201)
    assert ledger.count() == 1


async def test_an_invalid_key_is_400_and_a_repeated_owner_header_too(proxy: ProxyFactory) -> None:
    client = await proxy(status_header=STATUS)
    async with client.get("/payments", headers={STATUS: "a b"}) as response:
        await assert_problem(response, "key-invalid", 400)
    headers = [(STATUS, "k"), ("Authorization", "Bearer a"), ("Authorization", "Bearer b")]
    async with client.get("/payments", headers=headers) as response:
        await assert_problem(response, "header-invalid", 400)


async def test_an_owner_header_named_in_connection_is_400(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """SPEC §5, §7.1: the same answer as for a governed request, whose owner header would
    otherwise be stripped before the backend saw it."""
    client = await proxy(status_header=STATUS)
    async with client.post("/payments", data=b"pay", headers={KEY: "k9", **ALICE}) as response:
        assert response.status == 201
    hiding = {STATUS: "k9", **ALICE, "Connection": "Authorization"}
    async with client.get("/payments", headers=hiding) as response:
        await assert_problem(response, "header-invalid", 400)
    assert (await lookup(client, "k9", **ALICE))[0] == 200
    assert ledger.count() == 1


async def test_off_by_default_the_header_is_the_backends(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    async with client.get("/payments", headers={STATUS: "k5"}) as response:
        assert response.status == 201
    assert ledger.executions[0].header(STATUS) == "k5"


async def test_other_methods_with_the_header_pass_through(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(status_header=STATUS)
    async with client.delete("/payments/1", headers={STATUS: "k6"}) as response:
        assert response.status == 201
    assert [e.method for e in ledger.executions] == ["DELETE"]
    assert await jobs.list_jobs() == []


async def test_a_route_with_a_key_source_looks_the_value_up_with_its_prefix(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger
) -> None:
    key = {"pointer": "/order_id", "prefix": "order:"}
    route = {"prefix": "/orders", "upstream": backend_url, "key": key}
    client = await proxy(status_header=STATUS, routes=[route])
    body = b'{"order_id": "A-9"}'
    headers = {"Content-Type": "application/json", **ALICE}
    async with client.post("/orders", data=body, headers=headers) as response:
        assert response.status == 201
    async with client.get("/orders", headers={STATUS: "A-9", **ALICE}) as response:
        document = await response.json()
    assert (document["key"], document["state"]) == ("order:A-9", "completed")
    assert ledger.count() == 1


async def test_an_expired_job_is_not_found(proxy: ProxyFactory, ledger: Ledger) -> None:
    """Past its ttl the key is free again (SPEC §11): the lookup says so, not its old state."""
    client = await proxy(status_header=STATUS, ttl=0.5)
    async with client.post("/payments", data=b"pay", headers={KEY: "k7", **ALICE}) as response:
        assert response.status == 201
    assert (await lookup(client, "k7", **ALICE))[0] == 200
    await asyncio.sleep(1.2)
    assert (await lookup(client, "k7", **ALICE))[0] == 404
    assert ledger.count() == 1


async def test_an_unknown_job_past_its_ttl_is_still_unknown(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """SPEC §3.1: an unknown job is never swept, whatever its ttl. A lookup that called it not
    found (`retry: new-key-safe`) would send the client to run it again under a new key, while
    a retry of the key itself is refused (409 outcome-unknown)."""
    client = await proxy(status_header=STATUS, ttl=0.5, upstream_timeout=0.3)
    headers = {KEY: "k-unknown", **ALICE}
    async with client.post("/payments?delay=1", data=b"pay", headers=headers) as response:
        assert response.status == 504
    await asyncio.sleep(1.0)  # past the ttl
    status, document = await lookup(client, "k-unknown", **ALICE)
    assert (status, document["state"]) == (200, "unknown")
    async with client.post("/payments?delay=1", data=b"pay", headers=headers) as response:
        await assert_problem(response, "outcome-unknown", 409)
    await settle_quietly()
    assert ledger.count("k-unknown") == 1


async def test_lookups_are_counted_as_their_own_outcome(proxy: ProxyFactory) -> None:
    client = await proxy(status_header=STATUS)
    async with client.post("/payments", data=b"pay", headers={KEY: "k8", **ALICE}) as response:
        assert response.status == 201
    assert (await lookup(client, "k8", **ALICE))[0] == 200
    assert (await lookup(client, "k8", **MALLORY))[0] == 404
    registry = client.app[CONTEXT].metrics.registry
    assert counted(registry, "idemproxy_requests_total", outcome="status_lookup") == 2
    assert counted(registry, "idemproxy_requests_total", outcome="new") == 1
