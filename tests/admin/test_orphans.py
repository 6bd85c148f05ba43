"""SPEC §3.5: a job a dead proxy left in flight becomes `unknown` in the background, on both stores.

The dead proxy is a claim made straight on the store with a short lease that nobody renews (what
a SIGKILLed proxy leaves; tests/e2e/test_crash.py kills a real one). No request for its key
comes: the running proxy's background pass takes it over, so operators see it (the admin API,
`idemproxy_unknown_jobs`), can resolve it, and `unknown_ttl` can release it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from idemproxy.core.types import AttemptState, Intent, Job, JobState
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.app import create_app
from idemproxy.store.base import Store

from .conftest import MakeClient, MakeSettings, Upstream, post
from .test_delete_cas import RUNNING, in_flight
from .test_jobs_api import get_json

Client = TestClient[Any, Any]
LEASE = 0.3
TAKEOVER = {"interval": 60.0, "takeover_interval": 0.1}
# SPEC §3.5 as docs/operations.md states it: unknown within 2 x lease + takeover_interval of
# the proxy's death (here: of the claim), plus slack for a slow machine.
BOUND = 2 * LEASE + TAKEOVER["takeover_interval"] + 2.0


async def dead_proxys_job(store: Store, key: str = "orphan-1") -> Job:
    intent = Intent(owner="o", key=key, fingerprint="fp", method="POST", path="/charges")
    claimed = await store.claim(intent, str(uuid.uuid4()), "http://upstream", ttl=3600, lease=LEASE)
    return claimed.job


async def until_state(store: Store, job_id: str, state: JobState, within: float) -> Job:
    deadline = time.monotonic() + within
    while True:
        job = await store.get_by_id(job_id)
        if job is not None and job.state is state:
            return job
        assert time.monotonic() < deadline, f"job {job_id} is {job and job.state.value}"
        await asyncio.sleep(0.02)


async def proxy_with_metrics(
    store: Store,
    make_settings: MakeSettings,
    metrics: Metrics,
    sweeper: dict[str, float] = TAKEOVER,
    lease: float = LEASE,
    **overrides: Any,
) -> Client:
    # A renewal must fit in the lease: config/settings.py refuses store_timeout >= 2/3 of it.
    overrides.setdefault("pool", {"store_timeout": 0.15})
    settings = make_settings(lease=lease, sweeper=sweeper, **overrides)
    client = TestClient(TestServer(create_app(settings, store=store, metrics=metrics)))
    await client.start_server()
    return client


async def test_a_dead_proxys_job_becomes_unknown_without_any_retry(
    store: Store, make_settings: MakeSettings, make_admin: MakeClient
) -> None:
    metrics = Metrics()
    client = await proxy_with_metrics(store, make_settings, metrics)
    try:
        started = time.monotonic()
        job = await dead_proxys_job(store)
        taken = await until_state(store, job.id, JobState.UNKNOWN, BOUND)
        # No earlier than one lease after the lease ran out (a late renewal is not a death).
        assert time.monotonic() - started >= 2 * LEASE - 0.05
        assert taken.version == job.version + 1
        assert [(a.state, a.error) for a in taken.attempts] == [
            (AttemptState.UNKNOWN, "lease expired")
        ]
        # Set right after the pass that took it over, not at the gauge's next refresh (15 s).
        for _ in range(100):
            if metrics.unknown_jobs._value.get() == 1:
                break
            await asyncio.sleep(0.01)
        assert metrics.unknown_jobs._value.get() == 1
        assert metrics.orphans_taken_over._value.get() == 1

        admin = await make_admin()
        listed = await get_json(admin, "/jobs?state=unknown")
        assert [j["id"] for j in listed] == [job.id]
        body = {"as": "released", "version": taken.version}
        async with admin.post(f"/jobs/{job.id}/resolve", json=body) as response:
            assert response.status == 200, await response.text()
        assert (await until_state(store, job.id, JobState.RELEASED, 1.0)).resolution == "operator"
    finally:
        await client.close()


async def test_unknown_ttl_releases_a_dead_proxys_job(
    store: Store, make_settings: MakeSettings
) -> None:
    sweeper = {**TAKEOVER, "interval": 0.1}
    client = await proxy_with_metrics(store, make_settings, Metrics(), sweeper, unknown_ttl=0.2)
    try:
        job = await dead_proxys_job(store)
        released = await until_state(store, job.id, JobState.RELEASED, BOUND + 1.0)
        assert released.resolution == "unknown_ttl"
    finally:
        await client.close()


async def test_a_live_proxys_job_is_never_taken_over_in_the_background(
    store: Store, make_settings: MakeSettings
) -> None:
    client = await proxy_with_metrics(store, make_settings, Metrics())
    try:
        job = await dead_proxys_job(store)
        for _ in range(8):  # renewed as a live proxy does, every lease / 3
            await asyncio.sleep(LEASE / 3)
            assert await store.renew_lease(job, lease=LEASE)
        current = await store.get_by_id(job.id)
        assert current is not None and current.state is JobState.IN_FLIGHT
    finally:
        await client.close()


async def test_a_retry_that_takes_the_job_over_logs_and_counts_it(
    store: Store,
    make_settings: MakeSettings,
    upstream: Upstream,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/operations.md: every takeover is logged with the job id and counted, the one a
    retry of the key makes (its proxy died, or lost the store for longer than its lease) as
    the background's; the retry's own log line names the job its 409 is about."""
    caplog.set_level(logging.INFO)
    metrics = Metrics()
    # A lease the running proxy renews only every 10 s: a renewal between the test's own
    # (to zero) and the retry would hold the retry instead of letting it take the job over.
    client = await proxy_with_metrics(
        store, make_settings, metrics, sweeper={"interval": 60.0}, lease=30.0
    )
    try:
        upstream.delays.append(RUNNING)
        first = asyncio.create_task(post(client, "taken-by-retry"))
        running = await in_flight(store, "taken-by-retry")
        assert await store.renew_lease(running, lease=0)  # its lease runs out at once
        status, headers, _ = await post(client, "taken-by-retry")
        assert (status, headers["Idempotency-Error"]) == (409, "outcome-unknown")
        await first
    finally:
        await client.close()
    assert metrics.orphans_taken_over._value.get() == 1
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "lease ran out" in r.getMessage()
    ]
    assert len(warnings) == 1 and running.id in warnings[0] and "retry" in warnings[0], warnings
    lines = [r.fields for r in caplog.records if r.name == "idemproxy.requests"]  # type: ignore[attr-defined]
    refused = [line for line in lines if line["outcome"] == "unknown"]
    assert refused and all(line["job"] == running.id for line in refused), lines
