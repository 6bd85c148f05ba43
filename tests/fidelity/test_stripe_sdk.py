"""The official Stripe SDK (stripe-python), driven as its users drive it: its own retries, and
its own `Idempotency-Key` on every POST it may send again, in front of a payments backend that
charges every request it gets (no idempotency of its own) and answers the first request of a
key later than the SDK waits.

The SDK gives up on a request after its timeout and sends it again under the same key, with
the same form body (SPEC §6: the same fingerprint). Straight to the backend, the retry is a
second charge; through the proxy it is held until the first charge's answer is stored, or
replayed from the store (SPEC §2.3, §7): one charge, and the SDK gets the charge object that
charge made. The SDK also retries a `409`, which the proxy answers a held retry with after
`max_wait` (`request-in-flight`): that retry then gets the first answer too.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import stripe

from tests.fidelity.servers import Running, proxy

# The SDK's read timeout, and how long the backend takes over the first request of a key: the
# SDK gives that one up and sends it again.
SDK_TIMEOUT = 0.4
FIRST_ANSWER_AFTER = 1.2
API_KEY = "sk_test_fidelity"


@dataclass
class Charges:
    """The backend's ledger: the charges it made, per Idempotency-Key, in order."""

    by_key: dict[str, list[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def charge(self, key: str) -> tuple[str, bool]:
        """A new charge for `key`: its id, and whether it is the key's first."""
        with self.lock:
            made = self.by_key.setdefault(key, [])
            made.append(f"ch_{next(self.numbers):06d}")
            return made[-1], len(made) == 1


class _Payments(BaseHTTPRequestHandler):
    """`POST /v1/charges` as Stripe answers it, in the parts the SDK reads."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def do_POST(self) -> None:
        form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        charge_id, first = self.server.charges.charge(self.headers.get("Idempotency-Key", ""))
        if first:
            time.sleep(FIRST_ANSWER_AFTER)
        body = json.dumps(
            {
                "id": charge_id,
                "object": "charge",
                "amount": int(form["amount"][0]),
                "currency": form["currency"][0],
                "paid": True,
                "status": "succeeded",
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Request-Id", f"req_{charge_id}")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    charges: Charges


@pytest.fixture(scope="module")
def payments() -> Iterator[_Server]:
    server = _Server(("127.0.0.1", 0), _Payments)
    server.charges = Charges()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def idemproxy(payments: _Server, proxy_store: str, logs: Path) -> Iterator[Running]:
    upstream = f"http://127.0.0.1:{payments.server_address[1]}"
    with proxy(upstream, proxy_store, logs) as running:
        yield running


def _client(url: str) -> stripe.StripeClient:
    return stripe.StripeClient(
        API_KEY,
        base_addresses={"api": url},
        max_network_retries=3,
        http_client=stripe.RequestsClient(timeout=SDK_TIMEOUT),
    )


def _charge(url: str, key: str) -> Any:
    return _client(url).v1.charges.create(
        params={"amount": 1999, "currency": "eur", "source": "tok_visa"},
        options={"idempotency_key": key},
    )


def test_without_the_proxy_the_sdks_retry_charges_twice(payments: _Server, key: str) -> None:
    """The baseline: what the backend does with the SDK's retry on its own."""
    charge = _charge(f"http://127.0.0.1:{payments.server_address[1]}", key)
    made = payments.charges.by_key[key]
    assert len(made) == 2 and charge.id == made[1]  # the first charge's answer never arrived


def test_through_the_proxy_the_sdks_retry_charges_once(
    payments: _Server, idemproxy: Running, key: str
) -> None:
    charge = _charge(idemproxy.url, key)
    assert payments.charges.by_key[key] == [charge.id]  # one charge, and the SDK has it
    # The SDK's answer is its retry's: the first charge's, held, then replayed.
    assert _replayed(charge)
    assert (charge.amount, charge.currency, charge.status) == (1999, "eur", "succeeded")
    # Later calls with the key, as the SDK's users make them after a crash: the same charge.
    assert _charge(idemproxy.url, key).id == charge.id
    assert payments.charges.by_key[key] == [charge.id]


def test_the_sdks_own_keys_make_its_retries_charge_once(
    payments: _Server, idemproxy: Running
) -> None:
    """No key given: the SDK makes one for the request and keeps it across its retries."""
    before = {key: list(made) for key, made in payments.charges.by_key.items()}
    charge = _client(idemproxy.url).v1.charges.create(
        params={"amount": 500, "currency": "usd", "source": "tok_visa"}
    )
    new = {key: made for key, made in payments.charges.by_key.items() if key not in before}
    assert list(new.values()) == [[charge.id]]
    assert _replayed(charge)


def _replayed(charge: Any) -> bool:
    """Whether the SDK's answer was the proxy's replay of a stored one."""
    response = charge.last_response
    assert response is not None
    return bool(response.headers.get("Idempotent-Replayed") == "true")
