"""SPEC §2.3, §5, §8: a reused key with another payload is a conflict; owners never share jobs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from idemproxy.identity.intent import fingerprint
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxychecks import KEY, REPLAYED, assert_problem, only_job

from .conftest import ProxyFactory


@pytest.mark.parametrize(("profile", "status"), [("default", 409), ("ietf", 422)])
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        pytest.param("POST", "/orders", b'{"amount": 99}', id="other-body"),
        pytest.param("POST", "/orders?express=1", b'{"amount": 10}', id="other-query"),
        pytest.param("POST", "/refunds", b'{"amount": 10}', id="other-path"),
        pytest.param("PATCH", "/orders", b'{"amount": 10}', id="other-method"),
    ],
)
async def test_same_key_other_request_is_payload_mismatch(
    proxy: ProxyFactory,
    ledger: Ledger,
    jobs: Store,
    profile: str,
    status: int,
    method: str,
    path: str,
    body: bytes,
) -> None:
    client = await proxy(profile=profile)
    original: dict[str, Any] = {
        "data": b'{"amount": 10}',
        "headers": {KEY: "k1", "Content-Type": "application/json"},
    }
    async with client.post("/orders", **original) as first:
        assert first.status == 201
        first_body = await first.read()
    before = await only_job(jobs)

    async with client.request(method, path, data=body, headers=original["headers"]) as reuse:
        problem = await assert_problem(
            reuse, "payload-mismatch", status, retry="new-key-safe", job_state="completed"
        )
        assert problem["instance"] == f"urn:idemproxy:job:{before.id}"

    assert ledger.count() == 1
    assert await only_job(jobs) == before  # the stored job is untouched
    async with client.post("/orders", **original) as again:
        assert again.status == 201
        assert again.headers[REPLAYED] == "true"
        assert await again.read() == first_body


async def test_semantically_equal_json_is_the_same_intent(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    headers = {KEY: "json", "Content-Type": "application/json"}
    async with client.post("/orders", data=b'{"a": 1, "b": [1, 2]}', headers=headers) as first:
        assert first.status == 201
    async with client.post("/orders", data=b'{"b":[1,2],"a":1}', headers=headers) as second:
        assert second.status == 201
        assert second.headers[REPLAYED] == "true"
    assert ledger.count() == 1


async def test_different_authorization_never_shares_a_job(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy()
    answers: dict[str, list[tuple[int, str | None]]] = {}
    for user in ("alice", "bob", "alice", "bob"):
        headers = {KEY: "same-key", "Authorization": f"Bearer {user}"}
        async with client.post("/payments", data=b"pay", headers=headers) as response:
            assert response.status == 201
            execution = json.loads(await response.read())["execution"]
            replayed = response.headers.get(REPLAYED)
        answers.setdefault(user, []).append((execution, replayed))

    assert ledger.count("same-key") == 2
    assert answers["alice"] == [(1, None), (1, "true")]
    assert answers["bob"] == [(2, None), (2, "true")]
    owners = {job.owner for job in await jobs.list_jobs()}
    assert len(owners) == 2
    assert not any("alice" in owner or "bob" in owner for owner in owners)  # only hashes kept


async def test_owner_header_strategy_scopes_jobs_by_that_header(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy(owner={"strategy": "header:X-User"})

    async def post(user: str, authorization: str) -> str | None:
        headers = {KEY: "k", "X-User": user, "Authorization": authorization}
        async with client.post("/payments", data=b"pay", headers=headers) as response:
            assert response.status == 201
            return response.headers.get(REPLAYED)

    assert await post("u1", "Bearer a") is None
    assert await post("u1", "Bearer other") == "true"  # Authorization plays no part now
    assert await post("u2", "Bearer a") is None
    assert ledger.count("k") == 2


async def test_required_owner_missing_is_401_without_execution(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(owner={"required": True})
    async with client.post("/payments", data=b"pay", headers={KEY: "k"}) as response:
        await assert_problem(response, "owner-missing", 401)
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []


async def test_requests_without_credentials_share_the_anonymous_scope(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    for replayed in (None, "true"):
        async with client.post("/payments", data=b"pay", headers={KEY: "anon"}) as response:
            assert response.status == 201
            assert response.headers.get(REPLAYED) == replayed
    assert ledger.count() == 1


async def test_a_fingerprinted_header_s_other_value_is_another_payload(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    """SPEC §6, `fingerprint_headers`: one credential acting for two accounts (Stripe Connect's
    `Stripe-Account`) reuses a key for the second. Without the header in the fingerprint the
    second account was replayed the first's object, and its own request never ran."""
    client = await proxy(fingerprint_headers=["Stripe-Account"])
    body = b'{"amount": 100}'

    async def charge(account: str | None, key: str = "order-123") -> tuple[int, bool, bytes]:
        headers = {KEY: key, "Content-Type": "application/json", "Authorization": "Bearer sk_p"}
        if account is not None:
            headers["Stripe-Account"] = account
        async with client.post("/orders", data=body, headers=headers) as response:
            return response.status, REPLAYED in response.headers, await response.read()

    first = await charge("acct_A")
    assert first[:2] == (201, False)
    assert await charge("acct_A") == (201, True, first[2])  # the same account: a replay
    async with client.post(
        "/orders",
        data=body,
        headers={
            KEY: "order-123",
            "Content-Type": "application/json",
            "Authorization": "Bearer sk_p",
            "stripe-account": "acct_B",
        },
    ) as other:
        await assert_problem(other, "payload-mismatch", 409, retry="new-key-safe")
    assert ledger.count("order-123") == 1
    # Following the hint, the second account's charge runs once, under its own key.
    assert (await charge("acct_B", "order-123-b"))[:2] == (201, False)
    # Without the header too, the fingerprint is not the one before the setting: such a job is
    # never taken for one stored before it (`test_a_job_stored_before_the_setting_…`).
    assert (await charge(None, "plain"))[:2] == (201, False)
    plain = await jobs.get(await _owner(jobs, "plain"), "plain")
    assert plain is not None and plain.fingerprint != await _fingerprint_without_setting(body)
    assert (await charge("acct_B", "plain"))[:2] == (409, False)
    # Listed in `Connection`, it would be hashed and stripped before the backend saw it.
    async with client.post(
        "/orders",
        data=body,
        headers={KEY: "hidden", "Stripe-Account": "acct_A", "Connection": "Stripe-Account"},
    ) as hidden:
        await assert_problem(hidden, "header-invalid", 400)
    assert ledger.count("hidden") == 0


async def _owner(jobs: Store, key: str) -> str:
    [job] = [job for job in await jobs.list_jobs(limit=100) if job.key == key]
    return job.owner


async def _fingerprint_without_setting(body: bytes) -> str:
    return fingerprint(("POST", "/orders", "", "application/json", "", None), body)


async def test_a_job_stored_before_the_setting_is_matched_as_it_was(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """SPEC §6: turning `fingerprint_headers` on changes every fingerprint; a job stored before
    still matches the retries that matched it (by the fingerprint they had then), so no retry
    of it gets a `409 payload-mismatch` that invites a new key and a second execution."""
    headers = {
        KEY: "before",
        "Content-Type": "application/json",
        "Authorization": "Bearer sk_p",
        "Stripe-Account": "acct_A",
    }
    body = b'{"amount": 100}'
    before = await proxy()
    async with before.post("/orders", data=body, headers=headers) as first:
        assert first.status == 201
        answer = await first.read()
    after = await proxy(fingerprint_headers=["Stripe-Account"])
    for sent in (headers, {k: v for k, v in headers.items() if k != "Stripe-Account"}):
        async with after.post("/orders", data=body, headers=sent) as retry:
            assert (retry.status, REPLAYED in retry.headers) == (201, True)
            assert await retry.read() == answer
    assert ledger.count("before") == 1
