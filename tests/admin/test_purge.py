"""Erasure of one owner (SPEC §11): the admin API on both stores, next to a running proxy."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from idemproxy.errors import InvalidRequest
from idemproxy.ops.purge import owners_of_credential
from idemproxy.store.base import Store

from .conftest import BOB, MakeSettings, Upstream, post
from .test_jobs_api import assert_problem, make_unknown

Client = TestClient[Any, Any]
ALICE_HASH = hashlib.sha256(b"Bearer alice").hexdigest()


async def _purge(admin: Client, **body: Any) -> dict[str, Any]:
    async with admin.post("/owners/purge", json=body) as response:
        assert response.status == 200, await response.text()
        report: dict[str, Any] = await response.json()
        return report


async def _owned(store: Store, owner: str) -> list[str]:
    return [job.key for job in await store.list_jobs(owner=owner)]


async def test_purge_by_credential_erases_the_owner_and_a_retry_executes_again(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    for key in ("k1", "k2"):
        assert (await post(proxy, key))[0] == 201
    assert (await post(proxy, "k2"))[1].get("Idempotent-Replayed") == "true"
    assert (await post(proxy, "k1", owner=BOB))[0] == 201
    executed = upstream.executions
    assert executed == 3

    report = await _purge(admin, credential="Bearer alice")
    assert report["owner"] == ALICE_HASH  # hashed as the proxy hashes it
    assert (report["removed_jobs"], report["removed_attempts"]) == (2, 2)
    assert report["removed_by_state"] == {"completed": 2} and report["left"] == []
    assert await _owned(store, ALICE_HASH) == []

    # Erasure means the proxy no longer knows the key: a retry runs again, as a new job.
    status, headers, _ = await post(proxy, "k1")
    assert status == 201 and "Idempotent-Replayed" not in headers
    assert upstream.executions == executed + 1
    # Bob's job is untouched and still replayed.
    status, headers, _ = await post(proxy, "k1", owner=BOB)
    assert status == 201 and headers.get("Idempotent-Replayed") == "true"
    assert upstream.executions == executed + 1


async def test_unknown_and_in_flight_jobs_are_listed_and_left_unless_included(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    lost = await make_unknown(proxy, upstream, store, "lost")
    assert (await post(proxy, "done"))[0] == 201
    upstream.delays.append(1.5)
    running = asyncio.create_task(post(proxy, "running"))
    for _ in range(100):
        if "running" in await _owned(store, lost.owner):
            break
        await asyncio.sleep(0.02)

    report = await _purge(admin, owner=lost.owner)
    assert report["removed_by_state"] == {"completed": 1}
    left = {job["state"]: job["id"] for job in report["left"]}
    assert set(left) == {"unknown", "in_flight"} and left["unknown"] == lost.id
    assert sorted(await _owned(store, lost.owner)) == ["lost", "running"]

    report = await _purge(admin, owner=lost.owner, include_in_flight=True)
    assert report["removed_by_state"] == {"in_flight": 1, "unknown": 1}
    assert report["left"] == [] and await _owned(store, lost.owner) == []
    # The running request's outcome can no longer be stored: it says so, and is not run again.
    status, headers, _ = await running
    assert (status, headers["Idempotency-Error"]) == (409, "outcome-unknown")
    assert await _owned(store, lost.owner) == []


async def test_a_purge_runs_in_bounded_batches(admin: Client, proxy: Client, store: Store) -> None:
    for n in range(5):
        assert (await post(proxy, f"k{n}"))[0] == 201
    report = await _purge(admin, owner=ALICE_HASH, batch_size=2)
    assert (report["removed_jobs"], report["batches"]) == (5, 3)
    assert await store.list_jobs() == []


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"owner": ALICE_HASH, "credential": "Bearer alice"},
        {"owner": "a b"},
        {"owner": ALICE_HASH, "batch_size": 0},
        {"owner": ALICE_HASH, "batch_size": True},
        {"owner": ALICE_HASH, "include_in_flight": "yes"},
        {"owner": ALICE_HASH, "everything": True},
        {"credential": ""},
        [ALICE_HASH],
    ],
)
async def test_a_purge_names_exactly_one_owner(
    admin: Client, proxy: Client, store: Store, body: Any
) -> None:
    assert (await post(proxy, "kept"))[0] == 201
    async with admin.post("/owners/purge", json=body) as response:
        await assert_problem(response, 400, "invalid-request")
    assert await _owned(store, ALICE_HASH) == ["kept"]


def test_a_credential_is_hashed_under_the_configured_strategy(
    make_settings: MakeSettings,
) -> None:
    settings = make_settings(owner={"strategy": "header:X-Tenant"})
    acme = hashlib.sha256(b"acme").hexdigest()
    assert owners_of_credential("acme", settings.owner) == (acme, None)
    assert owners_of_credential("Bearer alice", make_settings().owner) == (ALICE_HASH, None)
    with pytest.raises(InvalidRequest):
        owners_of_credential("anyone", make_settings(owner={"strategy": "none"}).owner)


def test_in_the_pepper_transition_a_credential_names_its_legacy_owner_too(
    make_settings: MakeSettings,
) -> None:
    """SPEC §5: jobs from before `owner.pepper` are the same customer's; a purge by credential
    erases them as well (the CLI and the admin API purge both owners)."""
    pepper = {"pepper": "a-pepper-for-tests-of-32-bytes-at-least", "legacy_owners": True}
    peppered, legacy = owners_of_credential("Bearer alice", make_settings(owner=pepper).owner)
    assert legacy == ALICE_HASH
    assert peppered != ALICE_HASH and len(peppered) == 64
    alone = make_settings(owner={"pepper": "another pepper, of 32 bytes or more"})
    without = owners_of_credential("Bearer alice", alone.owner)
    assert without[1] is None


@pytest.mark.parametrize("sent", ["Bearer alice ", " Bearer alice", "\tBearer alice\t "])
def test_a_credential_is_hashed_without_the_whitespace_http_strips(
    make_settings: MakeSettings, sent: str
) -> None:
    """The proxy hashes a header value as its parser hands it over, without the whitespace
    around it (RFC 9110 §5.5): so does an erasure, or it would erase nothing and say so."""
    assert owners_of_credential(sent, make_settings().owner) == (ALICE_HASH, None)


@pytest.mark.parametrize("sent", ["Bearer alice\r", "Bearer alice\r\n", "Bearer\nalice", "a\0"])
def test_a_credential_no_header_could_carry_is_refused(
    make_settings: MakeSettings, sent: str
) -> None:
    with pytest.raises(InvalidRequest, match="line break or a NUL"):
        owners_of_credential(sent, make_settings().owner)


async def test_a_purge_by_a_credential_with_whitespace_or_an_upper_case_hash_erases_the_owner(
    admin: Client, proxy: Client, store: Store
) -> None:
    for key in ("k1", "k2"):
        assert (await post(proxy, key))[0] == 201
    report = await _purge(admin, credential="Bearer alice ")
    assert (report["owner"], report["removed_jobs"]) == (ALICE_HASH, 2)
    assert (await post(proxy, "k3"))[0] == 201
    report = await _purge(admin, owner=ALICE_HASH.upper())
    assert (report["owner"], report["removed_jobs"]) == (ALICE_HASH, 1)
    assert await _owned(store, ALICE_HASH) == []
