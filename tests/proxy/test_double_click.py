"""SPEC §1-§2: one job per intent. Concurrent identical requests execute once upstream."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.backend import Ledger
from tests.support.proxychecks import JOB, KEY, REPLAYED, assert_problem

from .conftest import ProxyFactory


@pytest.mark.parametrize("clicks", [2, 100])
async def test_concurrent_identical_posts_execute_once(
    proxy: ProxyFactory, ledger: Ledger, clicks: int
) -> None:
    # Every duplicate is held while the first runs: allow more waiters than the default bound.
    client = await proxy(max_waiters_per_key=clicks * 2)
    headers = {KEY: "double-click", "Authorization": "Bearer alice"}

    async def click() -> tuple[int, bytes, dict[str, str]]:
        async with client.post("/payments?delay=0.2", json={"amount": 10}, headers=headers) as r:
            return r.status, await r.read(), dict(r.headers)

    results = await asyncio.gather(*(click() for _ in range(clicks)))

    assert ledger.count("double-click") == 1
    assert {status for status, _, _ in results} == {201}
    assert len({body for _, body, _ in results}) == 1
    assert len({headers[JOB] for _, _, headers in results}) == 1
    replayed = [headers.get(REPLAYED) for _, _, headers in results]
    assert replayed.count("true") == clicks - 1
    assert replayed.count(None) == 1


async def test_waiters_over_the_per_key_bound_get_too_many_waiters(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy(max_waiters_per_key=2)

    async def click() -> tuple[int, str | None, str | None]:
        async with client.post("/payments?delay=2", data=b"x", headers={KEY: "busy"}) as r:
            if r.status == 503:
                await assert_problem(r, "too-many-waiters", 503)
            return r.status, r.headers.get(REPLAYED), r.headers.get("Retry-After")

    first = asyncio.create_task(click())
    # The duplicates are sent only once the first is executing upstream, so every one of them
    # meets the job in flight however slowly the machine runs.
    for _ in range(200):
        if "busy" in ledger.arrivals:
            break
        await asyncio.sleep(0.01)
    assert "busy" in ledger.arrivals
    duplicates = await asyncio.gather(*(click() for _ in range(7)))
    results = [await first, *duplicates]

    assert ledger.count("busy") == 1
    assert sorted(status for status, _, _ in results) == [201] * 3 + [503] * 5
    assert all(retry_after for status, _, retry_after in results if status == 503)
