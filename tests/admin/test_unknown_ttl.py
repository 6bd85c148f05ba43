"""SPEC §3.3: `unknown_ttl` (off by default) auto-releases unknown jobs nobody resolved in time."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from idemproxy.core.types import Claimed, Intent, Job, JobState
from idemproxy.proxy.background.sweeper import release_stale_unknown
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store

from .conftest import MakeClient, MakeSettings, Upstream, post
from .test_jobs_api import make_unknown

FAST_SWEEPER = {"interval": 0.05, "batch_size": 2}


async def wait_for(store: Store, job_id: str, state: JobState, timeout: float = 5.0) -> Job:
    deadline = time.monotonic() + timeout
    while True:
        job = await store.get_by_id(job_id)
        if job is not None and job.state is state:
            return job
        assert time.monotonic() < deadline, f"job {job_id} stayed {job and job.state}"
        await asyncio.sleep(0.02)


async def test_an_unknown_job_is_released_after_unknown_ttl_and_a_retry_runs(
    make_proxy: MakeClient,
    make_settings: MakeSettings,
    upstream: Upstream,
    store: Store,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = await make_proxy(make_settings(unknown_ttl=0.3, sweeper=FAST_SWEEPER))
    job = await make_unknown(proxy, upstream, store, "k-1")
    status, _headers, _body = await post(proxy, "k-1")
    assert status == 409  # still unknown: the ttl has not passed yet

    released = await wait_for(store, job.id, JobState.RELEASED)
    assert released.resolution == "unknown_ttl"
    assert released.version == job.version + 1
    assert any(job.id in r.getMessage() and "unknown_ttl" in r.getMessage() for r in caplog.records)

    status, headers, body = await post(proxy, "k-1")
    assert (status, json.loads(body)["execution"]) == (201, 2)
    assert "Idempotent-Replayed" not in headers


async def test_unknown_jobs_stay_unknown_by_default(
    make_proxy: MakeClient,
    make_settings: MakeSettings,
    upstream: Upstream,
    store: Store,
) -> None:
    settings = make_settings(sweeper=FAST_SWEEPER)
    assert settings.unknown_ttl is None
    proxy = await make_proxy(settings)
    job = await make_unknown(proxy, upstream, store, "k-1")
    await asyncio.sleep(0.5)  # ten sweeper passes
    after = await store.get_by_id(job.id)
    assert after is not None
    assert (after.state, after.version) == (JobState.UNKNOWN, job.version)
    status, _headers, _body = await post(proxy, "k-1")
    assert status == 409
    assert upstream.executions == 1


async def unknown(store: Store, key: str) -> Job:
    intent = Intent(owner="o", key=key, fingerprint="fp", method="POST", path="/p")
    claimed = await store.claim(intent, str(uuid.uuid4()), "http://u", ttl=3600, lease=30)
    assert isinstance(claimed, Claimed)
    assert await store.settle(claimed.job, 1, JobState.UNKNOWN, error="timeout")
    job = await store.get_by_id(claimed.job.id)
    assert job is not None
    return job


async def test_release_in_batches_only_what_is_old_enough(store: Store) -> None:
    old = [await unknown(store, f"old-{i}") for i in range(5)]
    await asyncio.sleep(0.3)
    fresh = await unknown(store, "fresh")
    assert await release_stale_unknown(store, older_than=0.2, batch_size=2) == 5
    for job in old:
        after = await store.get_by_id(job.id)
        assert after is not None
        assert (after.state, after.resolution) == (JobState.RELEASED, "unknown_ttl")
    after_fresh = await store.get_by_id(fresh.id)
    assert after_fresh is not None
    assert after_fresh.state is JobState.UNKNOWN
    assert await release_stale_unknown(store, older_than=0.2, batch_size=2) == 0


async def test_replicas_sweeping_at_once_release_each_job_once(
    store_dsn: str, store: Store
) -> None:
    jobs = [await unknown(store, f"k-{i}") for i in range(6)]
    await asyncio.sleep(0.1)
    other = create_store(store_dsn)  # a second replica's handle on the same database
    await other.open()
    try:
        counts = await asyncio.gather(
            release_stale_unknown(store, older_than=0.05, batch_size=4),
            release_stale_unknown(other, older_than=0.05, batch_size=4),
        )
    finally:
        await other.close()
    assert sum(counts) == len(jobs)
    for job in jobs:
        after = await store.get_by_id(job.id)
        assert after is not None
        assert (after.state, after.version) == (JobState.RELEASED, job.version + 1)
