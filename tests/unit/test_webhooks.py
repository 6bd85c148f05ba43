"""SPEC §4.2: webhook signatures, with the senders' published test vectors as data."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from pathlib import Path

import pytest
import yaml
from multidict import CIMultiDict, CIMultiDictProxy
from pydantic import ValidationError

from idemproxy.cli.main import main
from idemproxy.config.keys import WebhookSettings
from idemproxy.config.settings import load_settings
from idemproxy.errors import SignatureInvalid
from idemproxy.identity.webhooks import (
    WebhookVerifier,
    github_signature,
    standard_signature,
    stripe_signature,
)
from tests.support.webhooks import github_headers, standard_headers, stripe_headers

# Standard Webhooks' specification, "Signature scheme" example.
STANDARD_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
STANDARD_MSG_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
STANDARD_TIMESTAMP = "1614265330"
STANDARD_BODY = b'{"test": 2432232314}'
STANDARD_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
# GitHub's "Validating webhook deliveries", "Testing the webhook payload validation".
GITHUB_SECRET = "It's a Secret to Everybody"
GITHUB_BODY = b"Hello, World!"
GITHUB_SIGNATURE = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
STRIPE_SECRET = "whsec_test_stripe_endpoint_secret"


def headers(values: dict[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(values))


def standard_key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix("whsec_"))


def verifier(scheme: str, *keys: bytes, now: float | None = None) -> WebhookVerifier:
    clock = time.time if now is None else (lambda: now)
    return WebhookVerifier(scheme, "sender", keys, 300.0, clock)


def test_standard_webhooks_published_example_is_what_the_proxy_computes() -> None:
    key = standard_key(STANDARD_SECRET)
    computed = standard_signature(key, STANDARD_MSG_ID, STANDARD_TIMESTAMP, STANDARD_BODY)
    assert computed == STANDARD_SIGNATURE
    delivery = {
        "webhook-id": STANDARD_MSG_ID,
        "webhook-timestamp": STANDARD_TIMESTAMP,
        "webhook-signature": STANDARD_SIGNATURE,
    }
    verifier("standard", key, now=1614265330 + 10).verify(headers(delivery), STANDARD_BODY)


def test_github_published_example_is_what_the_proxy_computes() -> None:
    assert github_signature(GITHUB_SECRET.encode(), GITHUB_BODY) == GITHUB_SIGNATURE
    delivery = {"X-Hub-Signature-256": GITHUB_SIGNATURE}
    verifier("github", GITHUB_SECRET.encode()).verify(headers(delivery), GITHUB_BODY)


def test_stripe_signature_is_the_hmac_of_timestamp_dot_body() -> None:
    body = b'{"id": "evt_1"}'
    sent = stripe_headers(STRIPE_SECRET, body, timestamp=1700000000)
    assert sent["Stripe-Signature"] == "t=1700000000,v1=" + stripe_signature(
        STRIPE_SECRET.encode(), "1700000000", body
    )
    verifier("stripe", STRIPE_SECRET.encode(), now=1700000100).verify(headers(sent), body)


def test_the_test_signers_agree_with_the_published_examples() -> None:
    sent = standard_headers(
        STANDARD_SECRET, STANDARD_MSG_ID, STANDARD_BODY, timestamp=int(STANDARD_TIMESTAMP)
    )
    assert sent["webhook-signature"] == STANDARD_SIGNATURE
    sent = github_headers(GITHUB_SECRET, "d1", GITHUB_BODY)
    assert sent["X-Hub-Signature-256"] == GITHUB_SIGNATURE


@pytest.mark.parametrize(
    "change",
    [
        {"webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OF="},
        {"webhook-id": "msg_other"},
        {"webhook-timestamp": "1614265331"},
        {"webhook-signature": "v2," + STANDARD_SIGNATURE[3:]},
        {"webhook-signature": ""},
    ],
)
def test_standard_refuses_any_change(change: dict[str, str]) -> None:
    delivery = {
        "webhook-id": STANDARD_MSG_ID,
        "webhook-timestamp": STANDARD_TIMESTAMP,
        "webhook-signature": STANDARD_SIGNATURE,
        **change,
    }
    check = verifier("standard", standard_key(STANDARD_SECRET), now=1614265330)
    with pytest.raises(SignatureInvalid):
        check.verify(headers(delivery), STANDARD_BODY)


def test_standard_accepts_any_of_several_signatures_and_any_of_several_keys() -> None:
    old, new = standard_key(STANDARD_SECRET), b"another key of the sender"
    signature = standard_signature(new, "m1", "1614265330", b"{}")
    delivery = {
        "webhook-id": "m1",
        "webhook-timestamp": "1614265330",
        "webhook-signature": f"v1,bm90IGl0 {signature} v1a,c29tZXRoaW5n",
    }
    verifier("standard", old, new, now=1614265330).verify(headers(delivery), b"{}")
    with pytest.raises(SignatureInvalid):
        verifier("standard", old, now=1614265330).verify(headers(delivery), b"{}")


@pytest.mark.parametrize("offset", [-301, 301])
def test_standard_and_stripe_refuse_a_timestamp_outside_the_tolerance(offset: int) -> None:
    key = standard_key(STANDARD_SECRET)
    now = int(STANDARD_TIMESTAMP) + offset
    delivery = {
        "webhook-id": STANDARD_MSG_ID,
        "webhook-timestamp": STANDARD_TIMESTAMP,
        "webhook-signature": STANDARD_SIGNATURE,
    }
    with pytest.raises(SignatureInvalid, match="tolerance"):
        verifier("standard", key, now=now).verify(headers(delivery), STANDARD_BODY)
    sent = stripe_headers(STRIPE_SECRET, b"{}", timestamp=1700000000)
    with pytest.raises(SignatureInvalid, match="tolerance"):
        verifier("stripe", STRIPE_SECRET.encode(), now=1700000000 - offset).verify(
            headers(sent), b"{}"
        )


@pytest.mark.parametrize(
    "value",
    ["", "v1=abc", "t=1700000000", "t=1700000000,t=1700000001,v1=00", "t=-5,v1=00", "t=1e9,v1=0"],
)
def test_stripe_refuses_a_malformed_header(value: str) -> None:
    check = verifier("stripe", STRIPE_SECRET.encode(), now=1700000000)
    with pytest.raises(SignatureInvalid):
        check.verify(headers({"Stripe-Signature": value}), b"{}")


def test_stripe_accepts_the_second_v1_of_a_rotation() -> None:
    body = b'{"id": "evt_2"}'
    good = stripe_signature(STRIPE_SECRET.encode(), "1700000000", body)
    value = f"t=1700000000,v1={'0' * 64},v1={good},v0=ffff"
    verifier("stripe", STRIPE_SECRET.encode(), now=1700000000).verify(
        headers({"Stripe-Signature": value}), body
    )


def test_github_refuses_another_body_a_repeated_header_and_non_ascii() -> None:
    check = verifier("github", GITHUB_SECRET.encode())
    with pytest.raises(SignatureInvalid):
        check.verify(headers({"X-Hub-Signature-256": GITHUB_SIGNATURE}), b"Hello, World?")
    repeated = CIMultiDict([("X-Hub-Signature-256", GITHUB_SIGNATURE)] * 2)
    with pytest.raises(SignatureInvalid):
        check.verify(CIMultiDictProxy(repeated), GITHUB_BODY)
    with pytest.raises(SignatureInvalid):
        check.verify(headers({"X-Hub-Signature-256": "sha256=\udcff"}), GITHUB_BODY)


def test_settings_read_secrets_from_env_and_file_and_decode_standard_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SENDER_SECRET", STANDARD_SECRET)
    old = tmp_path / "old"
    old.write_text("whsec_" + base64.b64encode(b"old key").decode() + "\n")
    settings = WebhookSettings(
        scheme="standard", sender="acme", secrets=["env:SENDER_SECRET", f"file:{old}"]
    )
    assert settings.keys == (standard_key(STANDARD_SECRET), b"old key")
    assert "MfKQ9r8" not in repr(settings)
    stripe = WebhookSettings(scheme="stripe", sender="stripe", secrets=["env:SENDER_SECRET"])
    assert stripe.keys == (STANDARD_SECRET.encode(),)  # Stripe keys with the string itself


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"secrets": ["whsec_literal"]}, "never the secret itself"),
        ({"secrets": ["env:NOT_SET_ANYWHERE_X"]}, "NOT_SET_ANYWHERE_X is not set"),
        ({"secrets": []}, "at least 1"),
        ({"sender": "two words"}, "a name"),
        ({"secrets": ["env:BAD_BASE64"]}, "base64"),
    ],
)
def test_settings_refuse(
    fields: dict[str, object], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BAD_BASE64", "whsec_***")
    given: dict[str, object] = {"scheme": "standard", "sender": "acme", "secrets": ["env:X_SET"]}
    monkeypatch.setenv("X_SET", STANDARD_SECRET)
    with pytest.raises(ValidationError, match=message):
        WebhookSettings.model_validate({**given, **fields})


def test_a_non_utf8_webhook_id_is_signed_as_its_bytes() -> None:
    """aiohttp decodes a header's bytes that are not UTF-8 as surrogates (surrogateescape)."""
    key = b"k" * 24
    body = b"{}"
    content = b"msg_\xff.1614265330." + body
    sent = "v1," + base64.b64encode(hmac.digest(key, content, hashlib.sha256)).decode()
    assert standard_signature(key, "msg_\udcff", "1614265330", body) == sent
    delivery = {
        "webhook-id": "msg_\udcff",
        "webhook-timestamp": "1614265330",
        "webhook-signature": sent,
    }
    verifier("standard", key, now=1614265330).verify(headers(delivery), body)
    with pytest.raises(SignatureInvalid):
        verifier("standard", b"another key", now=1614265330).verify(headers(delivery), body)


def webhook_routes(*senders: str) -> list[dict[str, object]]:
    return [
        {
            "prefix": f"/hooks/{n}",
            "upstream": "http://127.0.0.1:3000",
            "webhook": {"scheme": "stripe", "sender": sender, "secrets": [f"env:SECRET_{n}"]},
        }
        for n, sender in enumerate(senders)
    ]


def test_two_routes_of_one_sender_are_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SPEC §4.2: Stripe sends one event, one id, to every endpoint subscribed to it; in one
    scope the second endpoint's deliveries would be 409 payload-mismatch for ever."""
    for n in range(3):
        monkeypatch.setenv(f"SECRET_{n}", f"whsec_endpoint_{n}")
    settings = load_settings(upstream="http://127.0.0.1:3000", routes=webhook_routes("a", "b", "c"))
    assert [r.webhook.sender for r in settings.routes if r.webhook] == ["a", "b", "c"]
    message = r"routes\[0\] \(/hooks/0\) and routes\[2\] \(/hooks/2\) both have webhook sender 'a'"
    with pytest.raises(ValidationError, match=message):
        load_settings(upstream="http://127.0.0.1:3000", routes=webhook_routes("a", "b", "a"))
    config = tmp_path / "idemproxy.yaml"
    config.write_text(yaml.safe_dump({"routes": webhook_routes("stripe", "stripe")}))
    assert main(["serve", "--config", str(config)]) == 2
    assert "routes[0] (/hooks/0) and routes[1] (/hooks/1)" in capsys.readouterr().err
