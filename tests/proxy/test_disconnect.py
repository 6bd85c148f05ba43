"""SPEC §2: a client hanging up cancels neither the upstream call nor the completion write."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from idemproxy.core.types import JobState
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxychecks import KEY, REPLAYED, eventually, wait_for_jobs, wait_for_state

from .conftest import ProxyFactory


@pytest.mark.parametrize("handler_cancellation", [False, True], ids=["serve", "cancelling"])
async def test_client_hanging_up_mid_attempt_still_completes_the_job(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store, handler_cancellation: bool
) -> None:
    # "cancelling": the aiohttp server cancels the handler task the moment the client goes.
    client = await proxy(handler_cancellation=handler_cancellation)
    request: dict[str, Any] = {"data": b"pay", "headers": {KEY: "gone"}}

    async def impatient() -> None:
        async with client.post("/payments?delay=0.5", **request) as response:
            await response.read()

    attempt = asyncio.create_task(impatient())
    await wait_for_jobs(jobs)  # claimed: the request is on its way upstream
    await asyncio.sleep(0.1)
    attempt.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attempt

    [job] = await jobs.list_jobs()
    await wait_for_state(jobs, job.id, JobState.COMPLETED)
    assert ledger.count("gone") == 1
    async with client.post("/payments?delay=0.5", **request) as retry:
        assert retry.status == 201
        assert retry.headers[REPLAYED] == "true"
        assert json.loads(await retry.read())["execution"] == 1
    assert ledger.count("gone") == 1


async def test_client_hanging_up_mid_stream_still_completes_the_job(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(max_stored_body=1000)
    url = "/export?size=2000000&chunked=1"
    async with client.post(url, data=b"x", headers={KEY: "stream"}) as response:
        assert response.status == 201
        await response.content.readexactly(1000)
        response.close()  # hang up with most of the body still to come

    await eventually(lambda: ledger.count("stream") == 1)
    [job] = await jobs.list_jobs()
    done = await wait_for_state(jobs, job.id, JobState.COMPLETED)
    assert done.response is not None and done.response.omitted
    async with client.post(url, data=b"x", headers={KEY: "stream"}) as retry:
        assert retry.headers[REPLAYED] == "true"
        assert retry.headers["Idempotency-Replay"] == "omitted"
    assert ledger.count("stream") == 1
