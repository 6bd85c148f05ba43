"""SPEC §5, strategy `jwt` with keys from an identity provider (`owner.jwt.jwks_uri`, or
`discovery` from `issuer`), through the real proxy, against a real HTTPS identity provider on
loopback (tests/support/idp.py) that counts every fetch: key rotation, the rate limit on
refreshes for unknown kids, a provider that is down or slow, a wrong issuer, a wrong CA."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from idemproxy import constants as c
from idemproxy.identity.jwt_keys import parse_jwks
from idemproxy.identity.jwt_owner import hash_claim
from idemproxy.proxy.context import CONTEXT
from idemproxy.proxy.idp import fetch as fetch_module
from idemproxy.proxy.idp import keys as remote_keys
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.idp import IdentityProvider
from tests.support.jwtkit import AUDIENCE, bearer, claims, ec_key, public_jwk, rsa_key, token
from tests.support.metrics import counted
from tests.support.proxychecks import KEY, REPLAYED, assert_problem, only_job

from .conftest import ProxyFactory

PAYMENT = {"amount": 10}
Client = TestClient[Any, Any]


@pytest.fixture
async def idp(tmp_path: Path) -> Any:
    async with IdentityProvider(tmp_path) as provider:
        provider.publish((rsa_key(0), "k1"))
        yield provider


def owner(idp: IdentityProvider, *, discovery: bool = False, **options: Any) -> dict[str, Any]:
    """owner settings: RS256 keys from `idp` (its JWKS URL, or discovery), trusted by its CA."""
    source: dict[str, Any] = (
        {"discovery": True, "issuer": idp.issuer} if discovery else {"jwks_uri": idp.jwks_uri}
    )
    tls = {"ca_file": str(options.pop("ca_file", idp.ca_file)), **options.pop("tls", {})}
    jwt = {
        **source,
        "algorithms": ["RS256"],
        "audience": [AUDIENCE],
        "idp": {"tls": tls, **options},
    }
    return {"strategy": "jwt", "jwt": jwt}


def signed(kid: str, index: int, sub: str = "alice", **extra: Any) -> dict[str, str]:
    return bearer(token(claims(sub, **extra), rsa_key(index), "RS256", kid=kid))


async def pay(client: Client, headers: dict[str, str], key: str = "k") -> tuple[int, Any]:
    async with client.post("/payments", json=PAYMENT, headers={KEY: key, **headers}) as response:
        await response.read()
        return response.status, response


async def test_a_key_rotated_in_is_fetched_once_and_its_tokens_keep_the_owner(
    proxy: ProxyFactory, idp: IdentityProvider, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(owner=owner(idp, min_refresh_interval=0.5))
    assert idp.jwks_fetches == 1  # at start-up, before the first request
    status, _ = await pay(client, signed("k1", 0))
    assert status == 201
    idp.publish((rsa_key(0), "k1"), (rsa_key(1), "k2"))  # the provider rotates
    await asyncio.sleep(0.6)
    # The retry is signed with the new key: one refresh finds it, and it is the same owner's
    # job (the owner is the issuer and subject, not the key), so it is replayed.
    async with client.post("/payments", json=PAYMENT, headers={KEY: "k", **signed("k2", 1)}) as r:
        assert r.status == 201, await r.text()
        assert r.headers.get(REPLAYED) == "true"
    assert idp.jwks_fetches == 2
    assert ledger.count() == 1
    job = await only_job(jobs)
    assert job.owner == hash_claim(claims()["iss"], "sub", "alice")


async def test_a_key_rotated_in_is_fetched_for_a_body_keyed_route_and_a_status_lookup(
    proxy: ProxyFactory, idp: IdentityProvider, backend_url: str, ledger: Ledger
) -> None:
    """The routes whose key has another source (SPEC §4.1) and the status lookup (§7.1) name
    the owner as the default path does: a token signed with a key rotated in waits for it."""
    client = await proxy(
        owner=owner(idp, min_refresh_interval=0.5),
        status_header="Idempotency-Status",
        routes=[{"prefix": "/orders", "upstream": backend_url, "key": {"pointer": "/id"}}],
    )
    idp.publish((rsa_key(0), "k1"), (rsa_key(1), "k2"))
    await asyncio.sleep(0.6)
    async with client.post("/orders", json={"id": "o-1"}, headers=signed("k2", 1)) as response:
        assert response.status == 201, await response.text()
    assert idp.jwks_fetches == 2
    idp.publish((rsa_key(0), "k1"), (rsa_key(1), "k2"), (rsa_key(2), "k3"))
    await asyncio.sleep(0.6)
    lookup = {"Idempotency-Status": "o-1", **signed("k3", 2)}
    async with client.get("/orders", headers=lookup) as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["state"] == "completed"
    assert idp.jwks_fetches == 3
    assert ledger.count() == 1


async def test_a_flood_of_unknown_kids_fetches_at_most_once_per_interval(
    make_proxy: ProxyFactory, sqlite_dsn: str, idp: IdentityProvider, ledger: Ledger
) -> None:
    client = await make_proxy(store=sqlite_dsn, owner=owner(idp, min_refresh_interval=3))
    await asyncio.sleep(3.1)  # one refresh is allowed again
    forged = [signed(f"forged-{n}", 2) for n in range(60)]
    for wave in range(2):
        answers = await asyncio.gather(
            *(pay(client, headers, key=f"w{wave}-{n}") for n, headers in enumerate(forged))
        )
        # Freshly signed: 401 once a fetch after its arrival lacked the kid, else 503 with the
        # seconds until the next fetch is allowed (SPEC §5).
        assert {status for status, _ in answers} <= {401, 503}
        for status, response in answers:
            if status == 503:
                assert 1 <= int(response.headers["Retry-After"]) <= 3
    # The start-up fetch and one refresh: 120 requests with unknown kids, 1 fetch for all.
    assert idp.jwks_fetches == 2
    # Signed well before the last fetch (more than the leeway): 401 at once, no fetch.
    old = signed("forged-old", 2, issued=-120)
    assert [
        status for status, _ in await asyncio.gather(*(pay(client, old) for _ in range(5)))
    ] == [401] * 5
    assert idp.jwks_fetches == 2
    # A token for an algorithm no configured key takes asks for no fetch at all.
    await asyncio.sleep(3.1)
    other = bearer(token(claims("alice"), ec_key(), "ES256", kid="forged-ec"))
    status, _ = await pay(client, other, key="ec")
    assert status == 401
    assert idp.jwks_fetches == 2
    assert ledger.count() == 0
    status, _ = await pay(client, signed("k1", 0))
    assert status == 201  # the known key still verifies, without a fetch
    assert idp.jwks_fetches == 2


async def test_a_token_signed_with_a_key_rotated_in_just_after_a_fetch_is_503_until_the_next(
    make_proxy: ProxyFactory, sqlite_dsn: str, idp: IdentityProvider, ledger: Ledger
) -> None:
    """SPEC §5, §8: the rate limit forbids a refresh for up to min_refresh_interval after any
    fetch. A token for a key rotated in meanwhile may be good: it is `503 identity-unavailable`
    with Retry-After saying when the next fetch is allowed (never 401), and its retry then
    finds the key; the fetches stay one per interval."""
    client = await make_proxy(store=sqlite_dsn, owner=owner(idp, min_refresh_interval=3))
    idp.publish((rsa_key(0), "k1"), (rsa_key(1), "k2"))  # rotated in just after start-up
    answers = await asyncio.gather(*(pay(client, signed("k2", 1)) for _ in range(10)))
    for status, response in answers:
        assert status == 503
        assert response.headers["Idempotency-Error"] == "identity-unavailable"
        assert 1 <= int(response.headers["Retry-After"]) <= 3
    assert idp.jwks_fetches == 1  # none allowed yet
    assert ledger.count() == 0
    await asyncio.sleep(int(answers[0][1].headers["Retry-After"]) + 0.1)
    status, _ = await pay(client, signed("k2", 1))
    assert status == 201  # the retry: one refresh found the key
    assert idp.jwks_fetches == 2
    assert ledger.count() == 1


async def test_keys_the_proxy_cannot_use_are_left_out_and_a_rotation_still_loads(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    idp: IdentityProvider,
    ledger: Ledger,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RFC 7517 §5: one entry the proxy cannot use (an encryption key, a weak or unknown one,
    `alg: none`) is left out and logged once; the provider's signing keys load beside it, so a
    rotated-in key verifies and a retired one stops verifying."""
    unusable = [
        public_jwk(rsa_key(3), "oaep", alg="RSA-OAEP"),
        public_jwk(rsa_key(4, 1024), "weak"),
        {"kty": "AKP", "kid": "pq", "alg": "ML-DSA-44", "pub": "AAAA"},
        {"kty": "OKP", "crv": "X25519", "kid": "x25519", "x": "AAAA"},
        {**public_jwk(rsa_key(5)), "kid": 7},
        public_jwk(rsa_key(6), "none", alg="none"),
    ]
    with caplog.at_level(logging.WARNING, "idemproxy.owner"):
        client = await make_proxy(store=sqlite_dsn, owner=owner(idp, min_refresh_interval=0.5))
        status, _ = await pay(client, signed("k1", 0), key="a")
        assert status == 201
        idp.jwks = [*unusable, public_jwk(rsa_key(1), "k2", alg="RS256", use="sig")]
        await asyncio.sleep(0.6)
        status, _ = await pay(client, signed("k2", 1), key="b")
        assert status == 201  # the rotated-in key, beside six it cannot use
        assert idp.jwks_fetches == 2
        await asyncio.sleep(0.6)
        status, _ = await pay(client, signed("k3", 2), key="c")  # another refresh
        assert status == 401
        assert idp.jwks_fetches == 3
    # k1 was retired with that rotation: its tokens no longer verify.
    status, _ = await pay(client, signed("k1", 0, issued=-120), key="d")
    assert status == 401
    assert ledger.count() == 2
    left_out = [r for r in caplog.records if "left out" in r.getMessage()]
    assert len(left_out) == 6  # each once, though fetched twice
    assert all(r.levelno == logging.WARNING for r in left_out)
    assert "(kid 'oaep')" in left_out[0].getMessage()


async def test_a_key_set_with_no_usable_key_is_a_failed_fetch(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    idp: IdentityProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    idp.jwks = [
        public_jwk(rsa_key(3), "oaep", alg="RSA-OAEP"),
        public_jwk(rsa_key(6), "n", alg="none"),
    ]
    with caplog.at_level(logging.WARNING, "idemproxy.owner"):
        client = await make_proxy(store=sqlite_dsn, owner=owner(idp))
    (logged,) = [r.getMessage() for r in caplog.records if "no keys yet" in r.getMessage()]
    assert "no signing key in the JWKS fits owner.jwt.algorithms" in logged
    assert "keys[0] (kid 'oaep')" in logged
    assert client.app[CONTEXT].owner.not_ready() is not None
    status, _ = await pay(client, signed("k1", 0))
    assert status == 503


async def test_keys_kept_through_a_day_of_failed_refreshes_are_an_error(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    idp: IdentityProvider,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kept however old (SPEC §5), but loudly: beyond STALE_KEYS_ERROR_SECONDS (a day; here
    shortened) each failed refresh is logged at error level with the keys' age."""
    monkeypatch.setattr(remote_keys, "STALE_KEYS_ERROR_SECONDS", 2.0)
    client = await make_proxy(store=sqlite_dsn, owner=owner(idp, min_refresh_interval=0.6))
    idp.status = 500
    with caplog.at_level(logging.WARNING, "idemproxy.owner"):
        for pause in (0.65, 1.5):  # the keys' age: about 0.7 s, then over 2 s
            await asyncio.sleep(pause)
            status, _ = await pay(client, signed("k2", 1))
            assert status == 503
    failed = [r for r in caplog.records if "refreshing the keys" in r.getMessage()]
    assert (failed[0].levelno, failed[-1].levelno) == (logging.WARNING, logging.ERROR), failed
    status, _ = await pay(client, signed("k1", 0), key="known")
    assert status == 201  # the keys kept still verify


async def test_a_large_jwks_is_parsed_without_stalling_other_requests(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    idp: IdentityProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A JWKS of thousands of keys (under the 1 MiB cap) takes a while to parse: it is parsed
    off the event loop, which meanwhile answers a pass-through request and never stops for
    more than a fraction of the parse (a generous bound)."""
    jwk = public_jwk(ec_key(0, "P-521"))
    idp.jwks = [public_jwk(rsa_key(0), "k1"), *({**jwk, "kid": f"{n}"} for n in range(4000))]
    document = json.dumps({"keys": idp.jwks}).encode()
    assert len(document) <= c.MAX_JWKS_BYTES, len(document)
    settings = owner(idp, min_refresh_interval=0.3)
    settings["jwt"]["algorithms"] = ["RS256", "ES512"]
    parsed_on: list[threading.Thread] = []

    def parse_where(*args: Any) -> Any:
        parsed_on.append(threading.current_thread())
        return parse_jwks(*args)

    monkeypatch.setattr(fetch_module, "parse_jwks", parse_where)
    client = await make_proxy(store=sqlite_dsn, owner=settings)
    began = time.perf_counter()
    parse_jwks(document, ["RS256", "ES512"], "the JWKS")
    blocking = time.perf_counter() - began  # what one parse would stall the loop for
    await asyncio.sleep(0.35)
    loop = asyncio.get_running_loop()
    gaps: list[float] = []

    async def probe() -> None:
        while True:
            before = loop.time()
            await asyncio.sleep(0.002)
            gaps.append(loop.time() - before)

    probing = asyncio.create_task(probe())
    refresh = asyncio.create_task(pay(client, signed("k2", 1)))  # an unknown kid: a refresh
    answered = 0
    while not refresh.done():
        async with client.get("/models") as response:
            assert response.status == 201
            answered += 1
    probing.cancel()
    status, _ = await refresh
    assert status == 401 and idp.jwks_fetches == 2
    assert answered >= 1
    # Off the event loop's thread: a wall-clock bound on the loop's gaps also measures the
    # machine (a busy one stalled a probe longer than the whole parse).
    assert parsed_on and threading.main_thread() not in parsed_on
    assert blocking > 0 and gaps


async def test_with_the_provider_down_known_keys_verify_and_unknown_kids_fail_closed(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    idp: IdentityProvider,
    ledger: Ledger,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = await make_proxy(store=sqlite_dsn, owner=owner(idp, min_refresh_interval=1))
    await idp.stop()
    await asyncio.sleep(1.1)
    with caplog.at_level(logging.WARNING, "idemproxy.owner"):
        status, _ = await pay(client, signed("k1", 0), key="a")
        assert status == 201  # the last good key set
        async with client.post(
            "/payments", json=PAYMENT, headers={KEY: "b", **signed("k2", 1)}
        ) as response:
            await assert_problem(response, "identity-unavailable", 503)
            # The next fetch is allowed min_refresh_interval after this failed one.
            assert response.headers["Retry-After"] == "1"
        # At once again (the failed fetch was moments ago): still closed, never forwarded.
        async with client.post(
            "/payments", json=PAYMENT, headers={KEY: "c", **signed("k2", 1)}
        ) as response:
            await assert_problem(response, "identity-unavailable", 503)
    assert ledger.count() == 1
    metrics = client.app[CONTEXT].metrics.registry
    assert counted(metrics, "idemproxy_requests_total", outcome="unavailable") == 2
    fetches = "idemproxy_identity_provider_fetches_total"
    assert metrics.get_sample_value(fetches, {"result": "succeeded"}) == 1  # at start-up
    assert metrics.get_sample_value(fetches, {"result": "failed"}) == 1  # the one refresh
    (warning,) = [r.getMessage() for r in caplog.records if "refreshing the keys" in r.getMessage()]
    assert "keeping the 1 key(s)" in warning
    await idp.start()  # back: the rotated key is found on the next refresh
    idp.publish((rsa_key(1), "k2"))
    await asyncio.sleep(1.1)
    status, _ = await pay(client, signed("k2", 1), key="d")
    assert status == 201


async def test_a_slow_provider_holds_a_request_at_most_the_timeout_and_nothing_else(
    make_proxy: ProxyFactory, sqlite_dsn: str, idp: IdentityProvider, ledger: Ledger
) -> None:
    """The request waiting for keys waits at most owner.jwt.idp.timeout; meanwhile the event
    loop serves other requests: a pass-through request is answered while the fetch hangs."""
    client = await make_proxy(
        store=sqlite_dsn, owner=owner(idp, min_refresh_interval=0.2, timeout=1.5)
    )
    await asyncio.sleep(0.3)
    idp.delay = 30.0
    loop = asyncio.get_running_loop()
    began = loop.time()
    waiting = asyncio.create_task(pay(client, signed("k2", 1)))
    while idp.pending == 0:  # the fetch reached the provider and hangs there
        assert loop.time() - began < 5, "the refresh never reached the provider"
        await asyncio.sleep(0.01)
    passed_began = loop.time()
    async with client.get("/models") as response:
        assert response.status == 201
    passed_took = loop.time() - passed_began
    assert idp.pending == 1 and not waiting.done()
    assert passed_took < 0.5, passed_took
    status, response = await waiting
    waited = loop.time() - began
    assert status == 503 and response.headers["Idempotency-Error"] == "identity-unavailable"
    assert 1.4 <= waited < 4, waited
    assert ledger.count() == 1  # the pass-through request only


async def test_keys_found_by_discovery_from_the_issuer(
    make_proxy: ProxyFactory, sqlite_dsn: str, idp: IdentityProvider
) -> None:
    client = await make_proxy(store=sqlite_dsn, owner=owner(idp, discovery=True))
    status, _ = await pay(client, signed("k1", 0, iss=idp.issuer))
    assert status == 201
    # Tokens from another issuer are refused: discovery pins owner.jwt.issuer.
    status, _ = await pay(client, signed("k1", 0, iss="https://other.example.test"), key="x")
    assert status == 401
    assert (idp.discovery_fetches, idp.jwks_fetches) == (1, 1)


async def test_a_discovery_document_naming_another_issuer_is_refused(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    idp: IdentityProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """OIDC Discovery §4.3: a document at the issuer's URL that names another issuer (another
    tenant's, a proxy's) is not believed, nor are the keys it points to."""
    idp.issuer_named = "https://evil.example.test/realms/test"
    with caplog.at_level(logging.WARNING, "idemproxy.owner"):
        client = await make_proxy(store=sqlite_dsn, owner=owner(idp, discovery=True))
    # One warning line at start-up, with the cause.
    (logged,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert logged.startswith("owner.jwt: no keys yet from the discovery document of https://")
    assert "names issuer 'https://evil.example.test/realms/test', not owner.jwt.issuer" in logged
    assert (idp.discovery_fetches, idp.jwks_fetches) == (1, 0)
    async with client.post(
        "/payments", json=PAYMENT, headers={KEY: "k", **signed("k1", 0, iss=idp.issuer)}
    ) as response:
        await assert_problem(response, "identity-unavailable", 503)


async def test_a_provider_whose_certificate_another_ca_signed_is_refused(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    idp: IdentityProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "idemproxy.owner"):
        client = await make_proxy(store=sqlite_dsn, owner=owner(idp, ca_file=idp.other_ca_file))
    (logged,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "no keys yet" in logged and "certificate verify failed" in logged, logged
    assert idp.jwks_fetches == 0  # refused in the handshake: no request reached it
    status, _ = await pay(client, signed("k1", 0))
    assert status == 503


async def test_a_provider_requiring_a_client_certificate_gets_the_configured_one(
    make_proxy: ProxyFactory, sqlite_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """owner.jwt.idp.tls is the upstream TLS settings' shape: a client certificate (mTLS)."""
    async with IdentityProvider(tmp_path, client_certificates=True) as idp:
        idp.publish((rsa_key(0), "k1"))
        cert = {"cert_file": str(idp.client_cert_file), "key_file": str(idp.client_key_file)}
        client = await make_proxy(store=sqlite_dsn, owner=owner(idp, tls=cert))
        status, _ = await pay(client, signed("k1", 0))
        assert status == 201
        assert idp.jwks_fetches == 1
        with caplog.at_level(logging.WARNING, "idemproxy.owner"):
            without = await make_proxy(store=sqlite_dsn, owner=owner(idp))
        status, _ = await pay(without, signed("k1", 0), key="other")
        assert status == 503
        assert idp.jwks_fetches == 1  # refused in the handshake
        assert any("no keys yet" in r.getMessage() for r in caplog.records)


async def test_cache_control_brings_a_refresh_forward_within_bounds(
    make_proxy: ProxyFactory, sqlite_dsn: str, idp: IdentityProvider
) -> None:
    """max-age=1 under a 60 s refresh_interval: fetched again after about 1 s, in the
    background; max-age=0 is held to min_refresh_interval."""
    idp.cache_control = "public, max-age=1"
    await make_proxy(
        store=sqlite_dsn, owner=owner(idp, refresh_interval=60, min_refresh_interval=0.5)
    )
    deadline = time.monotonic() + 5
    while idp.jwks_fetches < 2:
        assert time.monotonic() < deadline, "max-age was not respected"
        await asyncio.sleep(0.05)
    idp.cache_control = "no-cache"
    await asyncio.sleep(2.2)  # after about 1 s, then every 0.5 s at most
    assert 3 <= idp.jwks_fetches <= 2 + 1 + 4, idp.jwks_fetches
