"""SPEC §5: a request without the credential its owner strategy reads is in the anonymous scope,
which every such caller shares. Two callers keyed by `X-Api-Key` (or a session cookie) under the
default strategy sent the same Idempotency-Key, and the second was replayed the first's
response. Such a request is now refused before anything is claimed (401 owner-missing, its
detail naming the header and the settings that scope it); the strategy it names works, and a
request with no credential anywhere stays anonymous."""

from __future__ import annotations

import pytest

from tests.support.backend import Ledger
from tests.support.proxychecks import KEY, REPLAYED, assert_problem

from .conftest import ProxyFactory


@pytest.mark.parametrize(
    ("header", "alice", "mallory"),
    [
        ("X-Api-Key", "sk-ant-alice", "sk-ant-mallory"),
        ("Cookie", "sessionid=alice", "sessionid=mallory"),
    ],
)
async def test_two_callers_keyed_elsewhere_never_share_a_job(
    proxy: ProxyFactory, ledger: Ledger, header: str, alice: str, mallory: str
) -> None:
    client = await proxy()
    for credential in (alice, mallory):
        headers = {header: credential, KEY: "order-1"}
        async with client.post("/orders", json={"amount": 1}, headers=headers) as response:
            problem = await assert_problem(
                response, "owner-missing", 401, retry="new-key-safe", job_state="none"
            )
        assert header in problem["detail"] and credential not in problem["detail"]
    assert ledger.count() == 0


async def test_the_strategy_the_refusal_names_scopes_each_caller(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy(owner={"strategy": "header:X-Api-Key"})
    answers = []
    for credential in ("sk-ant-alice", "sk-ant-mallory", "sk-ant-alice"):
        headers = {"X-Api-Key": credential, KEY: "order-2"}
        async with client.post("/orders", json={"amount": 1}, headers=headers) as response:
            answers.append((response.status, REPLAYED in response.headers))
    assert answers == [(201, False), (201, False), (201, True)]
    assert ledger.count("order-2") == 2


async def test_a_request_with_no_credential_anywhere_is_still_governed_anonymously(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    for _ in range(2):
        async with client.post("/orders", json={"amount": 1}, headers={KEY: "anon-1"}) as response:
            assert response.status == 201
    assert ledger.count("anon-1") == 1


async def test_requests_the_proxy_does_not_govern_pass_with_their_credential(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    async with client.post("/orders", json={}, headers={"X-Api-Key": "k"}) as response:
        assert response.status == 201
    async with client.get("/orders", headers={"X-Api-Key": "k", KEY: "on-get"}) as response:
        assert response.status == 201
    assert [e.header("X-Api-Key") for e in ledger.executions] == ["k", "k"]
