"""`idemproxy demo --webhooks`: a sample webhook receiver behind the proxy (docs/webhooks.md).

Two senders deliver to it, one Stripe-style (`Stripe-Signature`, the event id in the body's
`/id`) and one Standard-Webhooks-style (`webhook-id`, `webhook-signature`); each redelivers in
a storm, as senders do after a timeout, and a forger tries its luck. The receiver's ledger
shows one execution per event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from idemproxy.cli.demo import start_app
from idemproxy.config.settings import Settings, load_settings
from idemproxy.identity.webhooks import standard_signature, stripe_signature
from idemproxy.proxy.app import create_app

LEDGER = web.AppKey("ledger", list)
STRIPE_SECRET = "whsec_demo_stripe_endpoint_secret"
ACME_KEY = b"acme's demo signing key!"
ACME_SECRET = "whsec_" + base64.b64encode(ACME_KEY).decode()
# Slower than the senders' patience: every redelivery of the storm arrives while it runs.
_WORK_SECONDS = 0.5


async def fulfil(request: web.Request) -> web.Response:
    """The sample receiver: every call ships an order, exactly what must not happen twice."""
    event = await request.json()
    await asyncio.sleep(_WORK_SECONDS)
    ledger = request.app[LEDGER]
    ledger.append(f"{request.path} {event['id']}")
    return web.json_response({"shipped": event["id"], "execution": len(ledger)})


async def show_ledger(request: web.Request) -> web.Response:
    return web.json_response(request.app[LEDGER])


def sample_receiver(_argv: list[str] | None = None) -> web.Application:
    """Also runnable on its own, for docs/webhooks.md:
    `python -m aiohttp.web -H 127.0.0.1 -P 3000 idemproxy.cli.demo_webhooks:sample_receiver`."""
    app = web.Application()
    app[LEDGER] = []
    app.router.add_post("/hooks/stripe", fulfil)
    app.router.add_post("/hooks/acme", fulfil)
    app.router.add_get("/ledger", show_ledger)
    return app


def demo_settings(receiver_url: str, folder: Path) -> Settings:
    """Both routes as docs/webhooks.md configures them, the secrets in files."""
    (folder / "stripe-secret").write_text(STRIPE_SECRET + "\n")
    (folder / "acme-secret").write_text(ACME_SECRET + "\n")
    routes = [
        _hook("/hooks/stripe", receiver_url, "stripe", folder / "stripe-secret"),
        _hook("/hooks/acme", receiver_url, "standard", folder / "acme-secret", sender="acme"),
    ]
    return load_settings(
        store=f"sqlite:///{folder / 'idemproxy.db'}", listen="127.0.0.1:0", routes=routes
    )


def _hook(
    prefix: str, upstream: str, scheme: str, secret: Path, sender: str = "stripe"
) -> dict[str, object]:
    webhook = {"scheme": scheme, "sender": sender, "secrets": [f"file:{secret}"]}
    return {"prefix": prefix, "upstream": upstream, "webhook": webhook}


async def run_webhooks_demo() -> int:
    receiver_runner, receiver_url = await start_app(receiver := sample_receiver())
    with tempfile.TemporaryDirectory() as folder:
        settings = demo_settings(receiver_url, Path(folder))
        proxy_runner, proxy_url = await start_app(create_app(settings))
        try:
            await _scenarios(proxy_url)
        finally:
            await proxy_runner.cleanup()
            await receiver_runner.cleanup()
    ledger = receiver[LEDGER]
    print(f"\nThe receiver executed {len(ledger)} time(s) for 3 events:")
    for line in ledger:
        print(f"  {line}")
    return 0 if sorted(ledger) == sorted(set(ledger)) and len(ledger) == 3 else 1


def stripe_delivery(event_id: str, *, amount: int = 2000) -> tuple[bytes, dict[str, str]]:
    """A Stripe-style delivery, signed afresh as each of Stripe's retries is."""
    body = json.dumps({"id": event_id, "type": "checkout.session.completed", "amount": amount})
    stamp = str(int(time.time()))
    signature = stripe_signature(STRIPE_SECRET.encode(), stamp, body.encode())
    return body.encode(), {"Stripe-Signature": f"t={stamp},v1={signature}"}


def standard_delivery(msg_id: str) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"id": msg_id, "type": "order.paid"}).encode()
    stamp = str(int(time.time()))
    return body, {
        "webhook-id": msg_id,
        "webhook-timestamp": stamp,
        "webhook-signature": standard_signature(ACME_KEY, msg_id, stamp, body),
    }


async def _deliver(
    session: aiohttp.ClientSession, url: str, delivery: tuple[bytes, dict[str, str]]
) -> str:
    body, headers = delivery
    headers = {"Content-Type": "application/json", **headers}
    async with session.post(url, data=body, headers=headers) as response:
        answer = json.loads(await response.read())
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        shown = answer["code"] if "code" in answer else f"execution {answer['execution']}"
        return f"{response.status} {shown}" + (" (replayed)" if replayed else "")


async def _scenarios(proxy: str) -> None:
    stripe, acme = f"{proxy}/hooks/stripe", f"{proxy}/hooks/acme"
    async with aiohttp.ClientSession() as session:
        print("1. Stripe-style: evt_1 delivered, then redelivered 4 times while it runs")
        storm = [_deliver(session, stripe, stripe_delivery("evt_1")) for _ in range(5)]
        for n, answer in enumerate(await asyncio.gather(*storm), start=1):
            print(f"   delivery {n}  → {answer}")
        print(f"   once more   → {await _deliver(session, stripe, stripe_delivery('evt_1'))}")

        print("2. Standard-Webhooks-style: msg_1 three times at once, then evt_1 from acme")
        storm = [_deliver(session, acme, standard_delivery("msg_1")) for _ in range(3)]
        for n, answer in enumerate(await asyncio.gather(*storm), start=1):
            print(f"   delivery {n}  → {answer}")
        print("   acme's evt_1 is not Stripe's: another sender, another scope")
        print(f"   evt_1       → {await _deliver(session, acme, standard_delivery('evt_1'))}")

        print("3. A forger replays evt_1's signature with a body of its own")
        body, headers = stripe_delivery("evt_1")
        forged = (body.replace(b"2000", b"1"), headers)
        print(f"   forged      → {await _deliver(session, stripe, forged)}")
