"""A claim that commits after the proxy answered 503 for it (proxy/background/unsent.py): nothing
was forwarded, so the proxy releases that job as soon as the store answers, instead of leaving a job
nobody runs to be taken over as `unknown` after its lease (docs/operations.md).

Here the store commits the claim and then fails the call, which is what a stalled server does
to a claim whose timeout ran out (tests/faults/test_db_faults.py shows it with a frozen one).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from idemproxy.core.types import AttemptState, Claimed, Intent, Job, JobState
from idemproxy.errors import StoreUnavailable
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.app import STORES
from idemproxy.proxy.background.unsent import NEVER_FORWARDED, UnsentClaims
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store
from idemproxy.store.ports import JobStore
from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient
from tests.support.proxychecks import (
    KEY,
    assert_problem,
    eventually,
    job_with_attempts,
    settle_quietly,
)

from .conftest import ProxyFactory

Claim = Callable[..., Awaitable[Any]]


def _fail_claims(client: ProxyClient, *, commit: bool) -> JobStore:
    """Every claim fails after the store committed it (`commit`) or without it."""
    store = client.app[CONTEXT].store
    real: Claim = store.claim

    async def claim(*args: Any, **kwargs: Any) -> Any:
        if commit:
            await real(*args, **kwargs)
        raise StoreUnavailable("the claim timed out")

    store.claim = claim  # type: ignore[method-assign]
    return store


def _restore_claims(store: JobStore) -> None:
    del store.claim  # the class's method again


def _unsent(client: TestClient[Any, Any], outcome: str) -> float:
    metrics: Metrics = client.app[CONTEXT].metrics
    value = metrics.registry.get_sample_value("idemproxy_unsent_claims_total", {"outcome": outcome})
    return value or 0.0


async def _post(client: TestClient[Any, Any], key: str) -> tuple[int, str | None]:
    async with client.post("/payments", data=b"pay", headers={KEY: key}) as response:
        if response.status == 503:
            await assert_problem(response, "store-unavailable", 503)
        return response.status, response.headers.get("Idempotent-Replayed")


async def test_a_claim_that_committed_after_its_503_is_released_and_its_retry_runs_once(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy(lease=30.0)
    store = _fail_claims(client, commit=True)
    assert await _post(client, "late") == (503, None)
    _restore_claims(store)
    unsent = client.app[CONTEXT].unsent
    await eventually(lambda: len(unsent) == 0)

    job = await job_with_attempts(client.app[STORES].record, "late")
    assert job.state is JobState.RELEASED and job.attempt_count == 1
    assert [(a.state, a.error) for a in job.attempts] == [(AttemptState.FAILED, NEVER_FORWARDED)]
    assert _unsent(client, "released") == 1
    assert ledger.count() == 0  # released because nothing was forwarded
    assert await _post(client, "late") == (201, None)  # the retry runs it, once
    assert await _post(client, "late") == (201, "true")
    assert ledger.count("late") == 1


async def test_a_claim_committed_after_its_caller_was_cancelled_is_released(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """A caller cancelled while its group-committed batch is in flight (store/batching.py): the
    statement runs to its end for the others, so the claim commits with nobody to run it."""
    client = await proxy(lease=30.0)
    store = client.app[CONTEXT].store
    real: Claim = store.claim

    async def claim(*args: Any, **kwargs: Any) -> Any:
        await real(*args, **kwargs)
        raise asyncio.CancelledError

    store.claim = claim  # type: ignore[method-assign]
    with contextlib.suppress(aiohttp.ClientError):
        await _post(client, "cancelled")
    _restore_claims(store)
    unsent = client.app[CONTEXT].unsent
    await eventually(lambda: _unsent(client, "released") == 1)
    job = await job_with_attempts(client.app[STORES].record, "cancelled")
    assert job.state is JobState.RELEASED
    assert [(a.state, a.error) for a in job.attempts] == [(AttemptState.FAILED, NEVER_FORWARDED)]
    assert len(unsent) == 0 and ledger.count() == 0
    assert await _post(client, "cancelled") == (201, None)  # the retry runs it, once
    assert ledger.count("cancelled") == 1


async def test_a_duplicate_held_behind_it_runs_once_it_is_released(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """Without the release the duplicate would wait its whole max_wait for a job nobody runs,
    then get 409 request-in-flight; after the lease, 409 outcome-unknown."""
    client = await proxy(lease=30.0, max_wait=10.0)
    store = _fail_claims(client, commit=True)
    assert await _post(client, "late") == (503, None)
    _restore_claims(store)
    started = time.monotonic()
    assert await _post(client, "late") == (201, None)
    assert time.monotonic() - started < 3.0
    assert ledger.count("late") == 1


async def test_a_claim_that_never_committed_is_looked_for_until_its_lease_would_end(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy(lease=0.5, pool={"store_timeout": 0.3})
    store = _fail_claims(client, commit=False)
    assert await _post(client, "lost") == (503, None)
    _restore_claims(store)
    unsent = client.app[CONTEXT].unsent
    assert len(unsent) == 1
    await eventually(lambda: len(unsent) == 0, timeout=5.0)
    assert _unsent(client, "not_committed") == 1
    assert await store.get("anonymous", "lost") is None
    assert await _post(client, "lost") == (201, None)
    assert ledger.count("lost") == 1


async def test_nothing_is_released_when_the_request_went_upstream_anyway(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """With on_store_error: passthrough a failed claim's request is forwarded (SPEC §11): its
    job, if the claim committed after all, may have executed, so it is not released."""
    client = await proxy(lease=30.0, on_store_error="passthrough")
    store = _fail_claims(client, commit=True)
    assert await _post(client, "forwarded") == (201, None)
    _restore_claims(store)
    await settle_quietly(0.3)
    assert len(client.app[CONTEXT].unsent) == 0
    assert (
        await job_with_attempts(client.app[STORES].record, "forwarded")
    ).state is JobState.IN_FLIGHT
    assert ledger.count("forwarded") == 1


# --- UnsentClaims on its own, against a real store ----------------------------------------


@pytest.fixture
async def store(store_dsn: str) -> AsyncIterator[Store]:
    store = create_store(store_dsn)
    await store.open()
    await store.migrate()
    try:
        yield store
    finally:
        await store.close()


async def _claimed(store: Store, key: str, *, lease: float = 30.0) -> Claimed:
    intent = Intent("alice", key, "fp", "POST", "/payments")
    claimed = await store.claim(intent, str(uuid.uuid4()), "primary", ttl=3600.0, lease=lease)
    assert isinstance(claimed, Claimed)
    return claimed


async def _settled(unsent: UnsentClaims) -> None:
    await eventually(lambda: len(unsent) == 0)
    await unsent.close()


async def test_a_job_taken_over_as_unknown_is_left_to_the_operator(store: Store) -> None:
    """SPEC §3.3: unknown leaves only by a resolution."""
    metrics = Metrics()
    claimed = await _claimed(store, "taken", lease=0.05)
    await asyncio.sleep(0.1)
    assert await store.take_over(claimed.job)
    unsent = UnsentClaims(store, metrics.unsent_outcome, lease=30.0)
    unsent.note("alice", "taken", claimed.job.id)
    await _settled(unsent)
    job = await store.get("alice", "taken")
    assert job is not None and job.state is JobState.UNKNOWN
    assert metrics.registry.get_sample_value(
        "idemproxy_unsent_claims_total", {"outcome": "moved_on"}
    )


async def test_another_claims_job_under_the_key_is_left_alone(store: Store) -> None:
    metrics = Metrics()
    claimed = await _claimed(store, "theirs")
    unsent = UnsentClaims(store, metrics.unsent_outcome, lease=30.0)
    unsent.note("alice", "theirs", str(uuid.uuid4()))  # ours never committed; theirs did
    await _settled(unsent)
    job = await store.get("alice", "theirs")
    assert job is not None and (job.id, job.state) == (claimed.job.id, JobState.IN_FLIGHT)


async def test_the_store_still_away_is_asked_again_with_a_backoff(store: Store) -> None:
    metrics = Metrics()
    claimed = await _claimed(store, "later")
    calls: list[float] = []
    real_get = store.get

    async def get(owner: str, key: str) -> Job | None:
        calls.append(time.monotonic())
        if len(calls) <= 4:
            raise StoreUnavailable("still away")
        return await real_get(owner, key)

    store.get = get  # type: ignore[method-assign]
    unsent = UnsentClaims(store, metrics.unsent_outcome, lease=30.0)
    unsent.note("alice", "later", claimed.job.id)
    await _settled(unsent)
    job = await real_get("alice", "later")
    assert job is not None and job.state is JobState.RELEASED
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert len(calls) == 5
    assert all(gap >= 0.9 * pause for gap, pause in zip(gaps, (0.1, 0.2, 0.4, 0.8), strict=True))


async def test_a_bounded_number_are_watched(store: Store) -> None:
    metrics = Metrics()
    unsent = UnsentClaims(store, metrics.unsent_outcome, lease=30.0, max_items=2)
    for key in ("a", "b", "c"):
        unsent.note("alice", key, str(uuid.uuid4()))
    assert len(unsent) == 2
    assert metrics.registry.get_sample_value(
        "idemproxy_unsent_claims_total", {"outcome": "dropped"}
    )
    await unsent.close()


async def test_an_unexpected_error_is_logged_and_the_claim_looked_for_again(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()
    claimed = await _claimed(store, "bug")
    real_get = store.get
    failures = [RuntimeError("a bug")]

    async def get(owner: str, key: str) -> Job | None:
        if failures:
            raise failures.pop()
        return await real_get(owner, key)

    store.get = get  # type: ignore[method-assign]
    unsent = UnsentClaims(store, metrics.unsent_outcome, lease=30.0)
    unsent.note("alice", "bug", claimed.job.id)
    await _settled(unsent)
    job = await real_get("alice", "bug")
    assert job is not None and job.state is JobState.RELEASED
    assert f"the follow-up of job {claimed.job.id} failed" in caplog.text
