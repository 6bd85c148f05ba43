"""SPEC §3.6: one execution per intent while unknown jobs resolve themselves, also when replicas
reconcile the same job at once, an operator resolves it meanwhile, the late original response
arrives, or the endpoint is asked again. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from idemproxy.config.settings import load_settings
from idemproxy.core.types import Claimed, Intent, Job, JobState, StoredResponse
from idemproxy.ops.resolution import ResponseRules
from idemproxy.proxy.background.ask import ReconcileClient
from idemproxy.proxy.background.endpoints import endpoints
from idemproxy.proxy.background.reconcile import Reconciler, Result
from idemproxy.proxy.upstream.client import UpstreamClient
from idemproxy.store.base import Store
from tests.support.reconciling import Payments, payments_backend

TTL = 3600.0
OPERATOR = StoredResponse(200, (("Content-Type", "text/plain"),), b"settled by hand")
LATE = StoredResponse(201, (), b"the original, late")


@pytest.fixture
def payments() -> Payments:
    return Payments()


@pytest.fixture
async def backend(payments: Payments) -> AsyncIterator[str]:
    async with payments_backend(payments) as url:
        yield url


@pytest.fixture
async def client() -> AsyncIterator[ReconcileClient]:
    upstream = UpstreamClient(timeout=5, connect_timeout=1, connections=8, keepalive=5)
    await upstream.open()
    yield ReconcileClient(upstream, 1 << 20)
    await upstream.close()


def reconciler(store: Store, client: ReconcileClient, backend: str) -> Reconciler:
    endpoint = {"url": f"{backend}/reconcile", "timeout": 1, "backoff": 0.01, "max_backoff": 0.01}
    route = {"prefix": "/payments", "upstream": backend, "resolve": {"reconcile": endpoint}}
    settings = load_settings(routes=[route])
    return Reconciler(store, client, endpoints(settings), ResponseRules.from_settings(settings))


async def unknown_job(store: Store, backend: str, key: str = "k1") -> tuple[Job, Job]:
    """The job as its attempt claimed it (in flight), and as it is now: `unknown`."""
    intent = Intent("alice", key, "fp", "POST", "/payments")
    claimed = await store.claim(intent, str(uuid.uuid4()), backend, ttl=TTL, lease=30)
    assert isinstance(claimed, Claimed)
    assert await store.settle(claimed.job, 1, JobState.UNKNOWN, error="timeout")
    job = await store.get_by_id(claimed.job.id)
    assert job is not None
    await asyncio.sleep(0.05)  # past its first backoff
    return claimed.job, job


def executed(payments: Payments, job: Job) -> None:
    """The backend did execute attempt 1 (its answer was lost on the way back)."""
    payments.executions[job.key] += 1
    payments.answers[(job.id, 1)] = {"execution": 1}


async def test_replicas_at_once_ask_once(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    _, job = await unknown_job(store, backend)
    executed(payments, job)
    replicas = [reconciler(store, client, backend) for _ in range(4)]
    results = await asyncio.gather(*(r.reconcile(job.id) for r in replicas))
    assert sorted(results, key=str) == sorted([Result.COMPLETED, None, None, None], key=str)
    assert len(payments.questions) == 1
    done = await store.get_by_id(job.id)
    assert done is not None and (done.state, done.resolution) == (JobState.COMPLETED, "reconcile")


async def test_the_operator_resolving_meanwhile_wins(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    _, job = await unknown_job(store, backend)

    async def operator_first(_: dict[str, Any]) -> None:
        assert await store.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL)

    payments.before_answer = operator_first  # the answer says "never executed": too late
    assert await reconciler(store, client, backend).reconcile(job.id) is Result.LOST
    found = await store.get_by_id(job.id)
    assert found is not None
    assert (found.state, found.resolution, found.response) == (
        JobState.COMPLETED,
        "operator",
        OPERATOR,
    )
    # Its question and answer are still on the attempt, as evidence.
    assert found.attempts[0].evidence[-1].verdict == "not_executed"


async def test_the_late_original_response_loses(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    as_claimed, job = await unknown_job(store, backend)
    executed(payments, job)
    assert await reconciler(store, client, backend).reconcile(job.id) is Result.COMPLETED
    # The original attempt's response, arriving now, never replaces the resolved one.
    assert not await store.complete(as_claimed, 1, LATE, ttl=TTL)
    found = await store.get_by_id(job.id)
    assert found is not None and found.response is not None
    assert found.response != LATE and found.resolution == "reconcile"


async def test_asked_again_after_it_resolved_asks_nothing(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    _, job = await unknown_job(store, backend)
    one = reconciler(store, client, backend)
    assert await one.reconcile(job.id) is Result.RELEASED
    assert await one.reconcile(job.id) is None
    assert await one.run_pass(10) == []
    assert len(payments.questions) == 1
    # And a second answer to the same question, at the version first read, changes nothing.
    assert not await store.resolve(job, JobState.COMPLETED, response=OPERATOR, ttl=TTL)


async def test_never_executed_does_not_release_a_job_another_attempt_may_have_run(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    """Hedged attempts on two upstreams: "never executed" about one says nothing of the other."""
    intent = Intent("alice", "hedged", "fp", "POST", "/payments")
    claimed = await store.claim(intent, str(uuid.uuid4()), backend, ttl=TTL, lease=30)
    assert isinstance(claimed, Claimed)
    assert await store.add_attempt(claimed.job, backend, lease=30) == 2
    await store.finish_attempt(claimed.job, 1, JobState.UNKNOWN, error="timeout")
    assert await store.settle(claimed.job, 2, JobState.UNKNOWN, error="timeout")
    await asyncio.sleep(0.05)
    payments.running.add((claimed.job.id, 1))  # attempt 1 still runs: its answer proves nothing
    assert await reconciler(store, client, backend).reconcile(claimed.job.id) is Result.UNKNOWN
    found = await store.get_by_id(claimed.job.id)
    assert found is not None and found.state is JobState.UNKNOWN
    assert found.attempts[0].evidence[-1].verdict == "unknown"
    assert found.attempts[1].evidence[-1].verdict == "not_executed"
    assert found.attempts[1].evidence[-1].reason == "never executed, but another attempt may have"
    # Once attempt 1 too is answered "never executed", nothing may have executed: released.
    payments.running.clear()
    await asyncio.sleep(1.1)  # the next question: after the endpoint's timeout and a backoff
    assert await reconciler(store, client, backend).reconcile(claimed.job.id) is Result.RELEASED


async def test_an_executed_earlier_attempt_completes_a_job_whose_last_never_executed(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    """A later attempt that proved nothing (a resend the upstream answered "in progress") is
    truthfully "never executed"; the first, which executed, is asked about too."""
    intent = Intent("alice", "resent", "fp", "POST", "/payments")
    claimed = await store.claim(intent, str(uuid.uuid4()), backend, ttl=TTL, lease=30)
    assert isinstance(claimed, Claimed)
    assert await store.add_attempt(claimed.job, backend, lease=30) == 2
    await store.finish_attempt(claimed.job, 1, JobState.UNKNOWN, error="timeout")
    assert await store.settle(claimed.job, 2, JobState.UNKNOWN, status=409)
    executed(payments, claimed.job)
    await asyncio.sleep(0.05)
    assert await reconciler(store, client, backend).reconcile(claimed.job.id) is Result.COMPLETED
    found = await store.get_by_id(claimed.job.id)
    assert found is not None and found.state is JobState.COMPLETED
    assert found.attempts[0].evidence[-1].verdict == "executed"


async def test_old_jobs_no_answer_resolves_never_keep_new_ones_waiting(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    for n in range(3):  # on a route without an endpoint: never asked about
        intent = Intent("alice", f"old-{n}", "fp", "POST", "/elsewhere")
        old = await store.claim(intent, str(uuid.uuid4()), backend, ttl=TTL, lease=30)
        assert isinstance(old, Claimed)
        assert await store.settle(old.job, 1, JobState.UNKNOWN, error="timeout")
    await asyncio.sleep(0.01)
    _, job = await unknown_job(store, backend, "new")
    executed(payments, job)
    assert await reconciler(store, client, backend).run_pass(batch_size=2) == [Result.COMPLETED]


async def test_one_pass_asks_about_every_due_job_not_only_the_newest(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    jobs = [(await unknown_job(store, backend, f"k{n}"))[1] for n in range(5)]
    for job in jobs:
        executed(payments, job)
    assert await reconciler(store, client, backend).run_pass(batch_size=2) == [
        Result.COMPLETED
    ] * len(jobs)
    for job in jobs:
        found = await store.get_by_id(job.id)
        assert found is not None and found.state is JobState.COMPLETED


async def test_an_attempt_that_answered_after_the_job_became_unknown_is_still_asked_about(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    """A taken-over attempt whose answer came late (kept for the operator, `discarded`): the
    backend, asked about it, completes the job; the proxy does not leave it to an operator."""
    as_claimed, job = await unknown_job(store, backend)
    assert not await store.complete(as_claimed, 1, LATE, ttl=TTL)  # kept, the job unknown
    executed(payments, job)
    await asyncio.sleep(0.05)  # past the first backoff after its answer
    assert [r for r in await reconciler(store, client, backend).run_pass(10)] == [Result.COMPLETED]
    found = await store.get_by_id(job.id)
    assert found is not None
    assert (found.state, found.resolution) == (JobState.COMPLETED, "reconcile")
    assert len(payments.questions) == 1


async def test_never_executed_about_an_attempt_its_upstream_answered_releases_nothing(
    store: Store, client: ReconcileClient, backend: str, payments: Payments
) -> None:
    """Its upstream answered it: a "never executed" about it cannot make the job run again."""
    as_claimed, job = await unknown_job(store, backend)
    assert not await store.complete(as_claimed, 1, LATE, ttl=TTL)
    await asyncio.sleep(0.05)
    assert await reconciler(store, client, backend).reconcile(job.id) is Result.UNKNOWN
    found = await store.get_by_id(job.id)
    assert found is not None and found.state is JobState.UNKNOWN
    assert found.attempts[0].evidence[-1].verdict == "not_executed"
    # The evidence says why for this very attempt: not another's possible execution.
    assert "its upstream answered it" in found.attempts[0].evidence[-1].reason
    assert len(payments.questions) == 1
