"""SPEC §3.3: a response that came after its job was taken over is kept on its attempt, shown by
`show`, and an operator can resolve the job with it (`from_attempt`), on both stores.

The takeover is made as one happens when the running proxy was cut off from the store for
longer than its lease: the lease is made to run out (a renewal with a lease of 0) and the job
taken over by the same compare-and-swap another proxy's request would use, while the upstream
call still runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from idemproxy.cli.ops import _resolution
from idemproxy.core.types import AttemptState, Job, JobState, StoredResponse
from idemproxy.errors import InvalidRequest
from idemproxy.ops.resolution import ResponseRules
from idemproxy.store.base import Store

from .conftest import Upstream, post
from .test_delete_cas import RUNNING, in_flight
from .test_jobs_api import assert_problem, get_json, job_with_key, resolve

Client = TestClient[Any, Any]


async def taken_over_late(proxy: Client, upstream: Upstream, store: Store, key: str) -> Job:
    """A job taken over while its attempt ran; that attempt then answered 201, too late."""
    upstream.delays.append(RUNNING)
    request = asyncio.create_task(post(proxy, key))
    running = await in_flight(store, key)
    assert await store.renew_lease(running, lease=0)  # its lease runs out at once
    current = await store.get(running.owner, running.key)
    assert current is not None and current.lease_expired
    assert await store.take_over(current)
    status, headers, _body = await request
    assert (status, headers["Idempotency-Error"]) == (409, "outcome-unknown")
    job = await job_with_key(store, key)
    assert job.state is JobState.UNKNOWN
    return job


async def test_a_late_response_is_kept_shown_and_resolves_the_job(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await taken_over_late(proxy, upstream, store, "k-1")
    [attempt] = job.attempts
    assert (attempt.state, attempt.status) == (AttemptState.DISCARDED, 201)
    assert attempt.late_bytes is not None and attempt.late_bytes > 0
    kept = await store.late_response(job, 1)
    assert isinstance(kept, StoredResponse) and json.loads(kept.body or b"")["execution"] == 1

    plain = await get_json(admin, f"/jobs/{job.id}")
    assert plain["attempts"][0]["late_response_bytes"] == attempt.late_bytes
    assert "late_response" not in plain["attempts"][0]  # a tenant's data: only when asked
    shown = await get_json(admin, f"/jobs/{job.id}?include=response")
    late = shown["attempts"][0]["late_response"]
    assert late["status"] == 201
    assert ["Location", "/things/1"] in late["headers"]
    assert json.loads(late["body"])["execution"] == 1

    body = {"as": "completed", "from_attempt": 1, "version": job.version}
    async with await resolve(admin, job.id, body) as response:
        assert response.status == 200, await response.text()
    status, headers, replayed = await post(proxy, "k-1")
    assert (status, headers.get("Idempotent-Replayed")) == (201, "true")
    assert replayed == kept.body  # the response it really had
    assert upstream.executions == 1


async def test_from_attempt_needs_a_kept_response(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    upstream.script.append(504)  # unknown on time: there is no late response
    status, _headers, _body = await post(proxy, "k-1")
    assert status == 504
    job = await job_with_key(store, "k-1")
    assert job.attempts[0].late_bytes is None
    for number, code, http in ((1, "no-late-response", 409), (2, "invalid-request", 400)):
        body = {"as": "completed", "from_attempt": number}
        async with await resolve(admin, job.id, body) as response:
            await assert_problem(response, http, code)
    body = {"as": "completed", "from_attempt": 1, "status": 200}
    async with await resolve(admin, job.id, body) as response:
        await assert_problem(response, 400, "invalid-request")
    assert (await job_with_key(store, "k-1")).state is JobState.UNKNOWN


def test_the_cli_takes_from_attempt_alone() -> None:
    rules = ResponseRules(unreplayed_headers=[], max_body=10)
    args = argparse.Namespace(
        as_="completed", status=None, header=[], body_file=None, from_attempt=2, expect_version=3
    )
    resolution = _resolution(args, rules)
    assert (resolution.state, resolution.from_attempt, resolution.version) == (
        JobState.COMPLETED,
        2,
        3,
    )
    with pytest.raises(InvalidRequest, match="--from-attempt"):
        _resolution(argparse.Namespace(**{**vars(args), "status": 200}), rules)
