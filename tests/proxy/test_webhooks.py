"""SPEC §4.2: webhook routes, with deliveries signed as each sender signs them, through the
running proxy to the recording backend (its ledger counts executions)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient
from tests.support.proxychecks import REPLAYED, assert_problem, raw_exchange, settle_quietly
from tests.support.webhooks import github_headers, standard_headers, stripe_event, stripe_headers

from .conftest import ProxyFactory

STRIPE_SECRET = "whsec_stripe_endpoint_secret_for_tests"
ACME_SECRET = "whsec_" + base64.b64encode(b"acme's signing key, 24 b").decode()
GLOBEX_SECRET = "whsec_" + base64.b64encode(b"globex signing key here!").decode()
OLD_ACME_SECRET = "whsec_" + base64.b64encode(b"acme's previous key....").decode()
GITHUB_SECRET = "It's a Secret to Everybody"


@pytest.fixture(autouse=True)
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_STRIPE_SECRET", STRIPE_SECRET)
    monkeypatch.setenv("TEST_ACME_SECRET", ACME_SECRET)
    monkeypatch.setenv("TEST_OLD_ACME_SECRET", OLD_ACME_SECRET)
    monkeypatch.setenv("TEST_GLOBEX_SECRET", GLOBEX_SECRET)
    monkeypatch.setenv("TEST_GITHUB_SECRET", GITHUB_SECRET)


def hook(prefix: str, upstream: str, scheme: str, sender: str, *secrets: str) -> dict[str, Any]:
    webhook = {"scheme": scheme, "sender": sender, "secrets": [f"env:{s}" for s in secrets]}
    return {"prefix": prefix, "upstream": upstream, "webhook": webhook}


async def receiver(proxy: ProxyFactory, backend_url: str, **overrides: Any) -> ProxyClient:
    return await proxy(
        routes=[
            hook("/hooks/stripe", backend_url, "stripe", "stripe", "TEST_STRIPE_SECRET"),
            hook(
                "/hooks/acme",
                backend_url,
                "standard",
                "acme",
                "TEST_ACME_SECRET",
                "TEST_OLD_ACME_SECRET",
            ),
            hook("/hooks/globex", backend_url, "standard", "globex", "TEST_GLOBEX_SECRET"),
            hook("/hooks/github", backend_url, "github", "github", "TEST_GITHUB_SECRET"),
        ],
        **overrides,
    )


def executions_of(ledger: Ledger, event_id: str) -> int:
    return sum(1 for e in ledger.executions if event_id.encode() in e.body)


async def deliver(
    client: ProxyClient, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes, bool]:
    async with client.post(path, data=body, headers=headers) as response:
        return response.status, await response.read(), REPLAYED in response.headers


async def test_stripe_redelivery_storm_executes_once(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """Concurrent redeliveries (each freshly signed, as Stripe retries) are held for the first,
    then later ones are answered from the stored response."""
    client = await receiver(proxy, backend_url)
    body = stripe_event("evt_1NG8Du2eZvKYlo2CUI79vXWy")
    now = int(time.time())
    storm = [
        deliver(
            client,
            "/hooks/stripe?delay=0.4",
            body,
            stripe_headers(STRIPE_SECRET, body, timestamp=now - n),
        )
        for n in range(12)
    ]
    answers = await asyncio.gather(*storm)
    assert {status for status, _, _ in answers} == {201}
    assert len({answer for _, answer, _ in answers}) == 1  # every one the first's bytes
    assert sum(1 for _, _, replayed in answers if not replayed) == 1
    for n in range(3):  # and later, one at a time
        sent = stripe_headers(STRIPE_SECRET, body, timestamp=now + n)
        status, answer, replayed = await deliver(client, "/hooks/stripe?delay=0.4", body, sent)
        assert (status, answer, replayed) == (201, answers[0][1], True)
    assert executions_of(ledger, "evt_1NG8Du2eZvKYlo2CUI79vXWy") == 1
    [job] = await jobs.list_jobs()
    assert (job.owner, job.key) == ("webhook:stripe", "evt_1NG8Du2eZvKYlo2CUI79vXWy")


async def test_standard_webhooks_redeliveries_execute_once_each_event(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    client = await receiver(proxy, backend_url)
    events = [f"msg_{n}" for n in range(4)]
    for _ in range(3):
        for msg_id in events:
            body = json.dumps({"type": "invoice.paid", "event": msg_id}).encode()
            status, _, _ = await deliver(
                client, "/hooks/acme", body, standard_headers(ACME_SECRET, msg_id, body)
            )
            assert status == 201
    assert [executions_of(ledger, f'"{m}"') for m in events] == [1, 1, 1, 1]
    assert sorted(j.key for j in await jobs.list_jobs()) == events


async def test_a_delivery_signed_with_the_previous_secret_is_accepted(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger
) -> None:
    client = await receiver(proxy, backend_url)
    body = b'{"rotated": true}'
    headers = standard_headers(OLD_ACME_SECRET, "msg_rotated", body)
    assert (await deliver(client, "/hooks/acme", body, headers))[0] == 201
    assert ledger.count() == 1


def forged(headers: dict[str, str], name: str) -> dict[str, str]:
    value = headers[name]
    flipped = value[:-2] + ("0" if value[-2] != "0" else "1") + value[-1]
    return {**headers, name: flipped}


async def test_bad_stale_or_misapplied_signatures_are_401_and_nothing_is_stored(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    client = await receiver(proxy, backend_url)
    body = stripe_event("evt_forged")
    stale = int(time.time()) - 301
    msg = b'{"event": "msg_x"}'
    attempts = [
        ("/hooks/stripe", body, forged(stripe_headers(STRIPE_SECRET, body), "Stripe-Signature")),
        ("/hooks/stripe", body, stripe_headers(STRIPE_SECRET, body, timestamp=stale)),
        ("/hooks/stripe", body, stripe_headers("whsec_someone_else", body)),
        ("/hooks/stripe", body, {"Content-Type": "application/json"}),
        (
            "/hooks/acme",
            msg,
            forged(standard_headers(ACME_SECRET, "msg_x", msg), "webhook-signature"),
        ),
        ("/hooks/acme", msg, standard_headers(ACME_SECRET, "msg_x", msg, timestamp=stale)),
        ("/hooks/acme", msg, standard_headers(GLOBEX_SECRET, "msg_x", msg)),  # another sender's
        (
            "/hooks/github",
            msg,
            forged(github_headers(GITHUB_SECRET, "d-1", msg), "X-Hub-Signature-256"),
        ),
    ]
    for path, payload, headers in attempts:
        async with client.post(path, data=payload, headers=headers) as response:
            await assert_problem(response, "signature-invalid", 401)
    await settle_quietly()
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []


async def test_a_replayed_signature_with_a_changed_body_is_401(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """An attacker who saw one signed delivery cannot send its headers with a body of theirs,
    before or after the real one was processed; the stored job is untouched."""
    client = await receiver(proxy, backend_url)
    body = stripe_event("evt_real", amount=2000)
    headers = stripe_headers(STRIPE_SECRET, body)
    changed = stripe_event("evt_real", amount=999999)
    async with client.post("/hooks/stripe", data=changed, headers=headers) as response:
        await assert_problem(response, "signature-invalid", 401)
    assert await jobs.list_jobs() == []
    assert (await deliver(client, "/hooks/stripe", body, headers))[0] == 201
    for path, payload, sent in [
        ("/hooks/stripe", changed, headers),
        ("/hooks/github", b"{}", github_headers(GITHUB_SECRET, "d-2", b'{"a": 1}')),
        ("/hooks/acme", b"{}", standard_headers(ACME_SECRET, "msg_y", b'{"a": 1}')),
    ]:
        async with client.post(path, data=payload, headers=sent) as response:
            await assert_problem(response, "signature-invalid", 401)
    assert ledger.count() == 1
    assert [e.body for e in ledger.executions] == [body]
    [job] = await jobs.list_jobs()
    assert job.key == "evt_real"


async def test_two_senders_with_the_same_event_id_do_not_collide(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    client = await receiver(proxy, backend_url)
    acme = b'{"from": "acme"}'
    globex = b'{"from": "globex"}'
    for _ in range(2):
        sent = standard_headers(ACME_SECRET, "msg_1", acme)
        assert (await deliver(client, "/hooks/acme", acme, sent))[0] == 201
        sent = standard_headers(GLOBEX_SECRET, "msg_1", globex)
        assert (await deliver(client, "/hooks/globex", globex, sent))[0] == 201
    assert sorted(e.body for e in ledger.executions) == [acme, globex]
    owners = sorted((j.owner, j.key) for j in await jobs.list_jobs())
    assert owners == [("webhook:acme", "msg_1"), ("webhook:globex", "msg_1")]


async def test_github_deliveries_are_keyed_by_x_github_delivery(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    client = await receiver(proxy, backend_url)
    body = b'{"ref": "refs/heads/main"}'
    delivery = "72d3162e-cc78-11e3-81ab-4c9367dc0958"
    answers = [
        await deliver(client, "/hooks/github", body, github_headers(GITHUB_SECRET, delivery, body))
        for _ in range(3)
    ]
    assert [replayed for _, _, replayed in answers] == [False, True, True]
    assert ledger.count() == 1
    [job] = await jobs.list_jobs()
    assert (job.owner, job.key) == ("webhook:github", delivery)


async def test_a_signed_delivery_without_an_event_id_follows_require_key(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """SPEC §4.1: the signature first, then the key's absence is `require_key`'s to decide."""
    client = await receiver(proxy, backend_url)
    body = b'{"object": "event"}'  # no /id
    for _ in range(2):
        assert (await deliver(client, "/hooks/stripe", body, stripe_headers(STRIPE_SECRET, body)))[
            0
        ] == 201
    assert ledger.count() == 2
    assert await jobs.list_jobs() == []
    strict = await proxy(
        routes=[
            {
                **hook("/hooks/stripe", backend_url, "stripe", "stripe", "TEST_STRIPE_SECRET"),
                "require_key": True,
            }
        ]
    )
    async with strict.post(
        "/hooks/stripe", data=body, headers=stripe_headers(STRIPE_SECRET, body)
    ) as response:
        await assert_problem(response, "key-missing", 400)
    async with strict.post("/hooks/stripe", data=body, headers={}) as response:
        await assert_problem(response, "signature-invalid", 401)
    assert ledger.count() == 2


async def test_a_webhook_route_answers_no_status_lookup(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger
) -> None:
    """Nobody can prove to be the sender on a lookup: its jobs are not shown to anyone."""
    client = await receiver(proxy, backend_url, status_header="Idempotency-Status")
    body = stripe_event("evt_private")
    assert (await deliver(client, "/hooks/stripe", body, stripe_headers(STRIPE_SECRET, body)))[
        0
    ] == 201
    async with client.get(
        "/hooks/stripe", headers={"Idempotency-Status": "evt_private"}
    ) as response:
        await assert_problem(response, "key-not-found", 404)
    assert ledger.count() == 1


async def test_log_lines_name_the_sender_and_count_refusals_as_rejected(
    proxy: ProxyFactory, backend_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    client = await receiver(proxy, backend_url)
    body = stripe_event("evt_logged")
    assert (await deliver(client, "/hooks/stripe", body, stripe_headers(STRIPE_SECRET, body)))[
        0
    ] == 201
    assert (await deliver(client, "/hooks/stripe", body, {}))[0] == 401
    fields = [r.fields for r in caplog.records if r.name == "idemproxy.requests"]  # type: ignore[attr-defined]
    assert [(f["outcome"], f["owner"]) for f in fields] == [
        ("new", "webhook:stripe"),
        ("rejected", None),
    ]
    assert STRIPE_SECRET not in caplog.text


async def test_a_large_chunked_delivery_is_verified_whole_and_replayed(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger
) -> None:
    """Beyond `server.spool_threshold` a body would go to a spool file; a webhook route keeps it
    in memory to verify it, and a chunked one is verified over its decoded bytes."""
    client = await receiver(proxy, backend_url, server={"spool_threshold": 1024})
    body = json.dumps({"id": "evt_large", "data": {"object": {"note": "x" * 20_000}}}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 4096):
            yield body[start : start + 4096]

    answers = []
    for _ in range(2):
        sent = stripe_headers(STRIPE_SECRET, body)
        async with client.post("/hooks/stripe", data=chunks(), headers=sent) as response:
            answers.append((response.status, REPLAYED in response.headers))
    assert answers == [(201, False), (201, True)]
    assert [e.body for e in ledger.executions] == [body]


def raw_standard_delivery(msg_id: bytes, body: bytes, secret: str | None) -> bytes:
    """A Standard Webhooks delivery whose `webhook-id` is exact bytes, signed over those bytes
    as the scheme says (or with a made-up signature when `secret` is None)."""
    stamp = str(int(time.time())).encode()
    if secret is None:
        signature = base64.b64encode(b"\x00" * 32)
    else:
        key = base64.b64decode(secret.removeprefix("whsec_"))
        mac = hmac.digest(key, msg_id + b"." + stamp + b"." + body, hashlib.sha256)
        signature = base64.b64encode(mac)
    return (
        b"POST /hooks/acme HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"webhook-id: " + msg_id + b"\r\nwebhook-timestamp: " + stamp + b"\r\n"
        b"webhook-signature: v1," + signature + b"\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


async def test_a_webhook_id_that_is_not_utf8_is_refused_as_unsigned(
    proxy: ProxyFactory,
    backend_url: str,
    ledger: Ledger,
    jobs: Store,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """aiohttp hands on a byte 0xFF as a surrogate; the signature is checked over the bytes that
    arrived: a forged one is 401, a signed one is no key (SPEC §4.1), and neither is an error."""
    caplog.set_level(logging.WARNING)
    client = await receiver(proxy, backend_url)
    body = b'{"type": "invoice.paid"}'
    status, headers, _ = await raw_exchange(client, raw_standard_delivery(b"msg_\xff", body, None))
    assert (status, ("Idempotency-Error", "signature-invalid") in headers) == (401, True)
    signed = raw_standard_delivery(b"msg_\xff", body, ACME_SECRET)
    assert (await raw_exchange(client, signed))[0] == 201  # verified; no valid key: untracked
    assert [e.body for e in ledger.executions] == [body]
    assert await jobs.list_jobs() == []
    strict = await proxy(
        routes=[
            {
                **hook("/hooks/acme", backend_url, "standard", "acme", "TEST_ACME_SECRET"),
                "require_key": True,
            }
        ]
    )
    status, headers, _ = await raw_exchange(strict, signed)
    assert (status, ("Idempotency-Error", "key-invalid") in headers) == (400, True)
    assert ledger.count() == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_prefix_alone_keeps_the_schemes_event_id(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """SPEC §4.1, §4.2: senders send no Idempotency-Key; the prefix goes before their id."""
    routes = [
        {
            **hook("/hooks/stripe", backend_url, "stripe", "stripe", "TEST_STRIPE_SECRET"),
            "key": {"prefix": "evt:"},
        },
        {
            **hook("/hooks/github", backend_url, "github", "github", "TEST_GITHUB_SECRET"),
            "key": {"prefix": "gh:"},
        },
    ]
    client = await proxy(routes=routes)
    body = stripe_event("evt_prefixed")
    push = b'{"ref": "refs/heads/main"}'
    for _ in range(2):
        sent = stripe_headers(STRIPE_SECRET, body)
        assert (await deliver(client, "/hooks/stripe", body, sent))[0] == 201
        sent = github_headers(GITHUB_SECRET, "d-prefixed", push)
        assert (await deliver(client, "/hooks/github", push, sent))[0] == 201
    assert ledger.count() == 2
    keys = sorted((j.owner, j.key) for j in await jobs.list_jobs())
    assert keys == [("webhook:github", "gh:d-prefixed"), ("webhook:stripe", "evt:evt_prefixed")]


async def test_a_github_delivery_resent_under_a_new_delivery_id_executes_again(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger, jobs: Store
) -> None:
    """The limitation docs/webhooks.md states: GitHub does not sign X-GitHub-Delivery, so a
    captured delivery re-sent with another one is a new event. A key in the payload, which
    the signature covers, closes it where the payload has a stable id."""
    body = b'{"hook_id": 42, "event": {"id": "ev-7"}}'
    resent = [github_headers(GITHUB_SECRET, f"d-{n}", body) for n in range(2)]
    client = await receiver(proxy, backend_url)
    assert [(await deliver(client, "/hooks/github", body, h))[2] for h in resent] == [False] * 2
    assert ledger.count() == 2
    route = hook("/hooks/github", backend_url, "github", "github", "TEST_GITHUB_SECRET")
    keyed = await proxy(routes=[{**route, "prefix": "/hooks/gh2", "key": {"pointer": "/event/id"}}])
    assert [(await deliver(keyed, "/hooks/gh2", body, h))[2] for h in resent] == [False, True]
    assert ledger.count() == 3
    assert sorted(j.key for j in await jobs.list_jobs()) == ["d-0", "d-1", "ev-7"]


async def test_the_owner_header_is_no_part_of_a_delivery_but_its_key_header_is(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger
) -> None:
    """SPEC §4.2, §5: a delivery's owner is its sender, on every scheme alike; the key header
    named in `Connection` would reach the receiver stripped, and is refused."""
    client = await receiver(proxy, backend_url)
    body = stripe_event("evt_connection")
    msg = b'{"event": "msg_connection"}'
    hiding = {"Authorization": "Bearer x", "Connection": "Authorization"}
    sent = {**stripe_headers(STRIPE_SECRET, body), **hiding}
    assert (await deliver(client, "/hooks/stripe", body, sent))[0] == 201
    sent = {**standard_headers(ACME_SECRET, "msg_connection", msg), **hiding}
    assert (await deliver(client, "/hooks/acme", msg, sent))[0] == 201
    sent = {**standard_headers(ACME_SECRET, "msg_hidden", msg), "Connection": "webhook-id"}
    async with client.post("/hooks/acme", data=msg, headers=sent) as response:
        await assert_problem(response, "header-invalid", 400)
    assert ledger.count() == 2
