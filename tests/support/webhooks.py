"""Webhook deliveries signed as each sender signs them, written from the senders' documents
rather than from the proxy's code, so that a mistake in one is not repeated in the other.

* Standard Webhooks (standardwebhooks.com, spec "Signature scheme"): HMAC-SHA256 over
  `msg_id.timestamp.body` with the base64 key after `whsec_`, sent as `v1,<base64>`.
* GitHub ("Validating webhook deliveries"): `sha256=` and the hex HMAC-SHA256 of the body.
* Stripe ("Verify webhook signatures manually"): `t=<unix>,v1=<hex HMAC-SHA256 of t.body>`,
  keyed with the endpoint secret's own characters.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time


def standard_headers(
    secret: str, msg_id: str, body: bytes, *, timestamp: int | None = None
) -> dict[str, str]:
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    key = base64.b64decode(secret.split("_", 1)[1])
    mac = hmac.new(key, msg_id.encode() + b"." + stamp.encode() + b"." + body, hashlib.sha256)
    signature = "v1," + base64.b64encode(mac.digest()).decode()
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": stamp,
        "webhook-signature": signature,
        "Content-Type": "application/json",
    }


def github_headers(secret: str, delivery: str, body: bytes) -> dict[str, str]:
    mac = hmac.new(secret.encode(), body, hashlib.sha256)
    return {
        "X-GitHub-Delivery": delivery,
        "X-Hub-Signature-256": "sha256=" + mac.hexdigest(),
        "X-GitHub-Event": "push",
        "Content-Type": "application/json",
    }


def stripe_headers(secret: str, body: bytes, *, timestamp: int | None = None) -> dict[str, str]:
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    mac = hmac.new(secret.encode(), stamp.encode() + b"." + body, hashlib.sha256)
    return {
        "Stripe-Signature": f"t={stamp},v1={mac.hexdigest()}",
        "Content-Type": "application/json",
    }


def stripe_event(event_id: str, amount: int = 2000) -> bytes:
    """A Stripe event as Stripe sends it: its id is the body's `/id`."""
    event = {
        "id": event_id,
        "object": "event",
        "type": "payment_intent.succeeded",
        "data": {"object": {"id": "pi_3MtwBwLkdIwHu7ix28a3tqPa", "amount": amount}},
    }
    return json.dumps(event).encode()
