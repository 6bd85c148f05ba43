"""SPEC §5: owners as HMAC-SHA256 under `owner.pepper`, and the transition from plain SHA-256
owners (`owner.legacy_owners`), through the proxy on SQLite and PostgreSQL: a job made before
the pepper is replayed or held after it, never executed a second time or split in two."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import Any

from idemproxy.core.types import Intent
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient, ProxyFactory
from tests.support.proxychecks import JOB, KEY, REPLAYED, only_job, wait_for_jobs

AUTHORIZATION = "Basic YWxpY2U6aHVudGVyMg=="  # a short password: crackable from a plain hash
PEPPER = "a pepper only the proxies know, 32 bytes or more"
PEPPERED: dict[str, Any] = {"owner": {"pepper": PEPPER}}
TRANSITION: dict[str, Any] = {"owner": {"pepper": PEPPER, "legacy_owners": True}}
PLAIN_OWNER = hashlib.sha256(AUTHORIZATION.encode()).hexdigest()
HMAC_OWNER = hmac.new(PEPPER.encode(), PLAIN_OWNER.encode(), hashlib.sha256).hexdigest()


async def send(client: ProxyClient, path: str = "/payments") -> tuple[int, dict[str, str], bytes]:
    headers = {KEY: "order-1", "Authorization": AUTHORIZATION}
    async with client.post(path, data=b"pay", headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


async def test_with_a_pepper_the_stored_owner_is_not_the_plain_hash(
    proxy: ProxyFactory, jobs: Store
) -> None:
    assert (await send(await proxy(**PEPPERED)))[0] == 201
    assert (await only_job(jobs)).owner == HMAC_OWNER != PLAIN_OWNER


async def test_a_job_from_before_the_pepper_is_replayed_in_the_transition(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    status, headers, body = await send(await proxy())
    assert status == 201 and (await only_job(jobs)).owner == PLAIN_OWNER

    again = await send(await proxy(**TRANSITION))

    assert (again[0], again[2], again[1][REPLAYED], again[1][JOB]) == (
        201,
        body,
        "true",
        headers[JOB],
    )
    assert ledger.count() == 1
    assert len(await jobs.list_jobs()) == 1  # not split under a second owner


async def test_without_the_transition_the_old_job_is_not_found(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    # Why the window exists: the peppered owner is a new scope, so the retry runs again.
    assert (await send(await proxy()))[0] == 201
    assert (await send(await proxy(**PEPPERED)))[0] == 201
    assert ledger.count() == 2


async def test_a_duplicate_across_the_switch_is_held_and_gets_the_first_answer(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    before, after = await proxy(), await proxy(**TRANSITION)
    first = asyncio.create_task(send(before, "/payments?delay=0.5"))
    await wait_for_jobs(jobs)

    duplicate = await send(after, "/payments?delay=0.5")

    original = await first
    assert (duplicate[0], duplicate[2], duplicate[1][REPLAYED]) == (201, original[2], "true")
    assert ledger.count() == 1
    assert (await only_job(jobs)).owner == PLAIN_OWNER


async def test_a_legacy_claim_that_lands_after_the_lookup_wins_and_the_new_job_goes(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    # A replica without the pepper claims the key between this request's lookup and claim:
    # the request's own new job is deleted, unforwarded, and it follows the legacy one.
    after = await proxy(**TRANSITION)
    store = after.app[CONTEXT].store
    original_get, calls = store.get, 0

    async def get_then_race(owner: str, key: str) -> Any:
        nonlocal calls
        calls += 1
        found = await original_get(owner, key)
        if calls == 1 and owner == PLAIN_OWNER:
            intent = Intent(PLAIN_OWNER, key, "elsewhere", "POST", "/payments")
            await jobs.claim(intent, "00000000-0000-7000-8000-000000000001", "x", ttl=60, lease=30)
        return found

    store.get = get_then_race  # type: ignore[method-assign]
    status, headers, _ = await send(after)

    assert status == 409 and headers["Idempotency-Error"] == "payload-mismatch"  # theirs
    assert ledger.count() == 0
    [job] = await jobs.list_jobs()
    assert job.owner == PLAIN_OWNER


async def test_an_expired_legacy_job_is_gone_and_the_new_one_is_peppered(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    assert (await send(await proxy(ttl=0.2)))[0] == 201
    await asyncio.sleep(0.6)

    status, headers, _ = await send(await proxy(**TRANSITION))

    assert status == 201 and REPLAYED not in headers  # SPEC §3.1: an expired job is gone
    assert ledger.count() == 2
    assert [job.owner for job in await jobs.list_jobs()] == [HMAC_OWNER]


async def test_a_duplicate_held_on_a_job_that_gives_way_to_a_legacy_one_never_runs_it(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    # A claims under the peppered owner; B, a duplicate, is held on A's new job; then a replica
    # without the pepper claims the legacy owner's key, A finds it and deletes its own job. B
    # wakes to no job: it must look under the legacy owner again, not claim and run afresh.
    after = await proxy(max_wait=1.0, **TRANSITION)
    store = after.app[CONTEXT].store
    original_get, legacy_lookups = store.get, 0
    duplicate: list[asyncio.Task[tuple[int, dict[str, str], bytes]]] = []

    async def get_with_a_race(owner: str, key: str) -> Any:
        nonlocal legacy_lookups
        if owner == PLAIN_OWNER:
            legacy_lookups += 1
            if legacy_lookups == 2:  # A's look after its claim: its job exists now
                duplicate.append(asyncio.create_task(send(after)))
                await _until(lambda: store.watch.waiting >= 1)  # B is held on A's job
                intent = Intent(PLAIN_OWNER, key, "elsewhere", "POST", "/payments")
                job_id = "00000000-0000-7000-8000-000000000002"
                await jobs.claim(intent, job_id, "x", ttl=60, lease=30)
        return await original_get(owner, key)

    store.get = get_with_a_race  # type: ignore[method-assign]
    first = await send(after)
    second = await duplicate[0]

    assert ledger.count() == 0, "nothing ran: the legacy job is another replica's"
    assert {first[1]["Idempotency-Error"], second[1]["Idempotency-Error"]} == {"payload-mismatch"}
    assert [job.owner for job in await jobs.list_jobs()] == [PLAIN_OWNER]


async def _until(condition: Any, seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not reached in time"
        await asyncio.sleep(0.01)
