"""SPEC §3.6: an `unknown` job on a route with a reconcile endpoint resolves itself, once, on
SQLite and PostgreSQL; an answer that proves nothing leaves it `unknown` with the evidence."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from idemproxy.core.types import Job, JobState
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from tests.support.proxyapp import ProxyClient, ProxyFactory
from tests.support.reconciling import HOSTILE, Payments, payments_backend

TIMEOUT = 0.3  # the route's upstream_timeout: `?delay=1` times out, `unknown`
SETTLE = 10.0  # an upper bound on how long the reconciler may take


@pytest.fixture
def payments() -> Payments:
    return Payments()


@pytest.fixture
async def backend(payments: Payments) -> AsyncIterator[str]:
    async with payments_backend(payments) as url:
        yield url


def settings(backend: str, store_dsn: str, **reconcile: Any) -> dict[str, Any]:
    endpoint = {"url": f"{backend}/reconcile", "timeout": 0.5, "backoff": 0.05,
                "max_backoff": 0.2, **reconcile}  # fmt: skip
    route = {"prefix": "/payments", "upstream": backend, "upstream_timeout": TIMEOUT,
             "resolve": {"reconcile": endpoint}}  # fmt: skip
    return {"store": store_dsn, "upstream": backend, "routes": [route],
            "sweeper": {"reconcile_interval": 0.05}}  # fmt: skip


async def pay(client: ProxyClient, key: str) -> tuple[int, dict[str, Any]]:
    response = await client.post("/payments", json={"amount": 5}, headers={"Idempotency-Key": key})
    return response.status, await response.json()


async def state_of(jobs: Store, key: str, want: JobState) -> Job:
    deadline = time.monotonic() + SETTLE
    while True:
        job = await jobs.get("anonymous", key)
        if job is not None and job.state is want:
            return job
        assert time.monotonic() < deadline, f"{key}: not {want} within {SETTLE}s ({job})"
        await asyncio.sleep(0.05)


async def test_an_executed_attempt_completes_with_its_response(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, payments: Payments, jobs: Store
) -> None:
    payments.delay = 1.0
    client = await make_proxy(**settings(backend, store_dsn))
    status, _ = await pay(client, "k1")
    assert status == 504  # the first client: the outcome is unknown
    job = await state_of(jobs, "k1", JobState.COMPLETED)
    assert job.resolution == "reconcile"
    # A retry gets the response the backend really gave; the payment ran once.
    response = await client.post("/payments", json={"amount": 5}, headers={"Idempotency-Key": "k1"})
    assert response.status == 201
    assert response.headers["Idempotent-Replayed"] == "true"
    assert (await response.json())["execution"] == 1
    assert payments.executions["k1"] == 1
    # What was asked: this job and its attempt, with the identity the attempt carried.
    question = payments.questions[-1]
    assert question == {"job": job.id, "key": "k1", "attempt": 1, "method": "POST",
                        "path": "/payments"}  # fmt: skip
    headers = payments.question_headers[-1]
    assert (headers["Idempotency-Job"], headers["Idempotency-Attempt"]) == (job.id, "1")
    shown = await jobs.get_by_id(job.id)
    assert shown is not None
    evidence = shown.attempts[0].evidence
    assert evidence[-1].verdict == "executed" and evidence[-1].status == 200
    # SPEC §13: counted by way and result.
    registry = client.app[CONTEXT].metrics.registry
    labels = {"way": "reconcile", "result": "completed"}
    assert registry.get_sample_value("idemproxy_resolutions_total", labels) == 1


async def test_never_executed_releases_it_for_one_new_attempt(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, payments: Payments, jobs: Store
) -> None:
    payments.drop = 0.5
    client = await make_proxy(**settings(backend, store_dsn))
    status, _ = await pay(client, "k2")
    assert status == 504
    job = await state_of(jobs, "k2", JobState.RELEASED)
    assert job.resolution == "reconcile"
    assert payments.executions["k2"] == 0
    # The retry runs it once (a second attempt under the same job), and only once.
    answers = await asyncio.gather(*(pay(client, "k2") for _ in range(3)))
    assert {status for status, _ in answers} == {201}
    assert payments.executions["k2"] == 1
    done = await jobs.get("anonymous", "k2")
    assert done is not None and (done.state, done.attempt_count) == (JobState.COMPLETED, 2)


@pytest.mark.parametrize("mode", HOSTILE)
async def test_an_answer_that_proves_nothing_leaves_it_unknown(
    make_proxy: ProxyFactory,
    store_dsn: str,
    backend: str,
    payments: Payments,
    jobs: Store,
    mode: str,
) -> None:
    payments.mode, payments.slow_seconds, payments.drop = mode, 2.0, 0.5
    client = await make_proxy(**settings(backend, store_dsn))
    status, _ = await pay(client, "k3")
    assert status == 504
    job = await state_of(jobs, "k3", JobState.UNKNOWN)
    deadline = time.monotonic() + SETTLE
    while len(payments.questions) < 2:  # asked again after its backoff
        assert time.monotonic() < deadline, "asked again"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    found = await jobs.get_by_id(job.id)
    assert found is not None and found.state is JobState.UNKNOWN
    (attempt,) = found.attempts
    assert attempt.checks >= 2
    assert attempt.evidence and {e.verdict for e in attempt.evidence} == {"unknown"}
    # Retries still get 409 outcome-unknown, and nothing ran.
    status, problem = await pay(client, "k3")
    assert (status, problem["code"]) == (409, "outcome-unknown")
    assert payments.executions["k3"] == 0


async def test_backoff_spaces_the_questions(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, payments: Payments, jobs: Store
) -> None:
    payments.mode, payments.drop = "error", 0.5
    client = await make_proxy(**settings(backend, store_dsn, backoff=0.2, max_backoff=0.4))
    await pay(client, "k4")
    await state_of(jobs, "k4", JobState.UNKNOWN)
    await asyncio.sleep(1.5)
    # 0.2 s to the first, then 0.4 s between each: at most 4 in 1.5 s (not one per 50 ms pass).
    assert 1 <= len(payments.questions) <= 4


async def test_off_by_default(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, payments: Payments, jobs: Store
) -> None:
    route = {"prefix": "/payments", "upstream": backend, "upstream_timeout": TIMEOUT}
    client = await make_proxy(store=store_dsn, upstream=backend, routes=[route],
                              sweeper={"reconcile_interval": 0.05})  # fmt: skip
    payments.delay = 0.5
    await pay(client, "k5")
    await asyncio.sleep(0.8)
    job = await jobs.get("anonymous", "k5")
    assert job is not None and job.state is JobState.UNKNOWN
    assert payments.questions == []


def asked_only_by_retries(backend: str, store_dsn: str, **reconcile: Any) -> dict[str, Any]:
    """The background reconciler runs once an hour: only retries ask."""
    return {**settings(backend, store_dsn, **reconcile), "sweeper": {"reconcile_interval": 3600}}


async def test_a_retry_asks_and_gets_the_response(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, payments: Payments, jobs: Store
) -> None:
    payments.delay = 0.5
    client = await make_proxy(**asked_only_by_retries(backend, store_dsn))
    assert (await pay(client, "k6"))[0] == 504
    await asyncio.sleep(0.8)  # past the backend's execution (0.5 s after it arrived)
    assert payments.executions["k6"] == 1
    status, body = await pay(client, "k6")
    assert (status, body["execution"]) == (201, 1)
    assert len(payments.questions) == 1
    job = await jobs.get("anonymous", "k6")
    assert job is not None and job.resolution == "reconcile"
    assert payments.executions["k6"] == 1


async def test_a_still_unknown_job_says_when_it_is_next_asked(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, payments: Payments
) -> None:
    payments.mode, payments.drop = "error", 0.5
    client = await make_proxy(
        **asked_only_by_retries(backend, store_dsn, backoff=0.05, max_backoff=30, timeout=0.5)
    )
    assert (await pay(client, "k7"))[0] == 504
    await asyncio.sleep(0.1)
    response = await client.post("/payments", json={"amount": 5}, headers={"Idempotency-Key": "k7"})
    problem = await response.json()
    assert (response.status, problem["code"], problem["retry"]) == (409, "outcome-unknown", "never")
    assert "ask the backend again at next_check_at" in problem["detail"]
    assert "an operator must" not in problem["detail"]
    assert len(payments.questions) == 1
    # Next due: its timeout plus the doubled backoff after the question just asked.
    assert 1 <= int(response.headers["Retry-After"]) <= 2
    assert datetime.fromisoformat(problem["next_check_at"]) > datetime.now(UTC)
    # Another retry before then asks nothing, and says the same.
    again = await client.post("/payments", json={"amount": 5}, headers={"Idempotency-Key": "k7"})
    assert again.status == 409 and "Retry-After" in again.headers
    assert (await again.json())["next_check_at"] == problem["next_check_at"]
    assert len(payments.questions) == 1
    assert payments.executions["k7"] == 0


async def test_without_a_reconcile_endpoint_the_problem_is_as_before(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, payments: Payments
) -> None:
    payments.delay = 0.5
    route = {"prefix": "/payments", "upstream": backend, "upstream_timeout": TIMEOUT}
    client = await make_proxy(store=store_dsn, upstream=backend, routes=[route])
    assert (await pay(client, "k8"))[0] == 504
    response = await client.post("/payments", json={"amount": 5}, headers={"Idempotency-Key": "k8"})
    assert response.status == 409 and "Retry-After" not in response.headers
    plain = await response.json()
    assert "next_check_at" not in plain
    assert "an operator must resolve it" in plain["detail"]
