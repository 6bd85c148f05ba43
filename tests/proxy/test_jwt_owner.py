"""SPEC §5, strategy `jwt`, through the real proxy in front of a real upstream.

A token is an owner only once verified: a forged one (wrong key, unsigned, HMAC over the public
key, tampered claims) is 401 owner-missing, never reaches the backend and never sees the stored
response of the subject it claims, nor the anonymous scope's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from idemproxy.identity.jwt_owner import hash_claim
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.jwtkit import (
    AUDIENCE,
    ISSUER,
    bearer,
    claims,
    ec_key,
    hmac_token,
    public_pem,
    rsa_key,
    token,
    unsigned,
    with_payload,
    write_pem,
)
from tests.support.proxychecks import KEY, REPLAYED, assert_problem, only_job

from .conftest import ProxyFactory

PAYMENT = {"amount": 10, "currency": "EUR"}


def alice(**overrides: Any) -> str:
    return token(claims("alice", **overrides), rsa_key(), "RS256")


@pytest.fixture
def jwt_owner(tmp_path: Path) -> dict[str, Any]:
    """owner settings: RS256 with the public half of `rsa_key()`, audience AUDIENCE."""
    pem = write_pem(tmp_path / "idp.pem", rsa_key())
    jwt = {"key": str(pem), "algorithms": ["RS256"], "audience": [AUDIENCE]}
    return {"strategy": "jwt", "jwt": jwt}


@pytest.fixture
async def client(proxy: ProxyFactory, jwt_owner: dict[str, Any]) -> TestClient[Any, Any]:
    return await proxy(owner=jwt_owner)


async def pay(client: TestClient[Any, Any], headers: dict[str, str], key: str = "k") -> Any:
    async with client.post("/payments", json=PAYMENT, headers={KEY: key, **headers}) as response:
        return response.status, response.headers.get(REPLAYED), await response.read()


FORGERIES = {
    "wrong-key": lambda: token(claims("alice"), rsa_key(1), "RS256"),
    "alg-none": lambda: unsigned(claims("alice")),
    "hmac-over-public-pem": lambda: hmac_token(claims("alice"), public_pem(rsa_key())),
    "other-algorithm": lambda: token(claims("alice"), ec_key(), "ES256"),
    "tampered-claims": lambda: with_payload(
        token(claims("mallory"), rsa_key(), "RS256"), claims("alice")
    ),
}


@pytest.mark.parametrize("forgery", FORGERIES.values(), ids=FORGERIES.keys())
async def test_a_forged_token_for_another_subject_gets_401_and_not_their_response(
    client: TestClient[Any, Any], ledger: Ledger, forgery: Any
) -> None:
    status, _, body = await pay(client, bearer(alice()))
    assert status == 201
    assert json.loads(body)["execution"] == 1

    async with client.post("/payments", json=PAYMENT, headers={KEY: "k", **bearer(forgery())}) as r:
        problem = await assert_problem(r, "owner-missing", 401)
    assert "alice" not in json.dumps(problem)
    assert ledger.count() == 1  # the forged request never reached the backend


async def test_a_forged_token_never_falls_into_the_anonymous_scope(
    client: TestClient[Any, Any], ledger: Ledger
) -> None:
    """owner.required is false: no token is anonymous, but an invalid token is still 401."""
    status, replayed, _ = await pay(client, {})
    assert (status, replayed) == (201, None)
    assert (await pay(client, {}))[1] == "true"  # anonymous replays to anonymous

    for forged in (unsigned(claims("alice")), "not-a-jwt"):
        async with client.post(
            "/payments", json=PAYMENT, headers={KEY: "k", **bearer(forged)}
        ) as response:
            await assert_problem(response, "owner-missing", 401)
    async with client.post(
        "/payments", json=PAYMENT, headers={KEY: "k", "Authorization": "Basic YTpi"}
    ) as response:
        await assert_problem(response, "owner-missing", 401)
    assert ledger.count() == 1


async def test_a_refreshed_token_for_the_same_subject_replays(
    client: TestClient[Any, Any], ledger: Ledger, jobs: Store
) -> None:
    first = alice(issued=-120, lifetime=300)
    refreshed = alice(lifetime=3600)
    assert first != refreshed

    status, replayed, body = await pay(client, bearer(first))
    assert (status, replayed) == (201, None)
    again = await pay(client, bearer(refreshed))
    assert again == (201, "true", body)
    assert ledger.count() == 1

    # Only a hash of the issuer and subject is stored: neither the token nor the raw `sub`.
    owner = (await only_job(jobs)).owner
    assert owner == hash_claim(ISSUER, "sub", "alice")
    assert "alice" not in owner and first not in owner


async def test_two_users_with_the_same_key_get_separate_jobs(
    client: TestClient[Any, Any], ledger: Ledger, jobs: Store
) -> None:
    bob = token(claims("bob"), rsa_key(), "RS256")
    alice_first = await pay(client, bearer(alice()))
    bob_first = await pay(client, bearer(bob))
    assert alice_first[:2] == bob_first[:2] == (201, None)
    assert ledger.count() == 2
    assert await pay(client, bearer(alice())) == (201, "true", alice_first[2])
    assert await pay(client, bearer(bob)) == (201, "true", bob_first[2])
    owners = {job.owner for job in await jobs.list_jobs()}
    assert owners == {hash_claim(ISSUER, "sub", "alice"), hash_claim(ISSUER, "sub", "bob")}


async def test_an_expired_token_gets_401(client: TestClient[Any, Any], ledger: Ledger) -> None:
    expired = alice(issued=-7200, lifetime=3600)
    async with client.post(
        "/payments", json=PAYMENT, headers={KEY: "k", **bearer(expired)}
    ) as response:
        problem = await assert_problem(response, "owner-missing", 401)
    assert problem["detail"] == "The bearer token has expired."
    assert ledger.count() == 0


async def test_a_token_for_another_audience_gets_401(
    client: TestClient[Any, Any], ledger: Ledger
) -> None:
    other = alice(aud="https://another-api.example.test")
    assert (await pay(client, bearer(other)))[0] == 401
    assert ledger.count() == 0


async def test_required_owner_without_a_token_gets_401(
    proxy: ProxyFactory, jwt_owner: dict[str, Any], ledger: Ledger
) -> None:
    client = await proxy(owner={**jwt_owner, "required": True})
    async with client.post("/payments", json=PAYMENT, headers={KEY: "k"}) as response:
        await assert_problem(response, "owner-missing", 401)
    assert (await pay(client, bearer(alice())))[0] == 201
    assert ledger.count() == 1


async def test_hs256_with_a_secret_from_the_environment(
    proxy: ProxyFactory, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "a-shared-secret-of-at-least-32-bytes!"
    monkeypatch.setenv("IDEMPROXY_TEST_JWT_SECRET", secret)
    jwt = {"key": "env:IDEMPROXY_TEST_JWT_SECRET", "algorithms": "HS256", "audience": AUDIENCE}
    client = await proxy(owner={"strategy": "jwt", "jwt": jwt})
    signed = token(claims("alice"), secret, "HS256")
    assert (await pay(client, bearer(signed)))[:2] == (201, None)
    assert (await pay(client, bearer(token(claims("alice"), secret, "HS256"))))[1] == "true"
    forged = token(claims("alice"), secret + "x", "HS256")
    assert (await pay(client, bearer(forged)))[0] == 401
    assert ledger.count() == 1
