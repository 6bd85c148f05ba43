"""Verifying a webhook delivery's signature before anything is claimed (SPEC §4.2).

Three schemes, each as its sender publishes it:
* `standard` (Standard Webhooks): `webhook-signature: v1,<base64>` (space-separated, several
  during a rotation), an HMAC-SHA256 over `<webhook-id>.<webhook-timestamp>.<body>` with the
  base64-decoded `whsec_` secret; the timestamp within the tolerance either way.
* `github`: `X-Hub-Signature-256: sha256=<hex>`, an HMAC-SHA256 over the body with the secret.
* `stripe`: `Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>…]`, an HMAC-SHA256 over
  `<t>.<body>` with the secret's own bytes; `t` within the tolerance either way.

Every comparison is `hmac.compare_digest`: how long a refusal takes says nothing about how much
of a forged signature was right.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from multidict import CIMultiDictProxy

from idemproxy import constants as c
from idemproxy.errors import SignatureInvalid

_UNIX_TIME = re.compile(r"[0-9]{1,12}")


@dataclass(frozen=True, slots=True)
class WebhookVerifier:
    scheme: str
    sender: str
    keys: tuple[bytes, ...] = field(repr=False)
    tolerance: float = c.DEFAULT_WEBHOOK_TOLERANCE_SECONDS
    clock: Callable[[], float] = field(default=time.time, compare=False, repr=False)

    @property
    def owner(self) -> str:
        """SPEC §4.2: two senders never share a scope, whatever their event ids."""
        return c.WEBHOOK_OWNER_PREFIX + self.sender

    def verify(self, headers: CIMultiDictProxy[str], body: bytes) -> None:
        """Return if the delivery is signed with one of the keys; `SignatureInvalid` if not."""
        if self.scheme == "standard":
            signed = _standard(headers, body, self._fresh)
        elif self.scheme == "github":
            signed = _github(headers, body)
        else:
            signed = _stripe(headers, body, self._fresh)
        if not any(signed(key) for key in self.keys):
            raise SignatureInvalid()

    def _fresh(self, timestamp: str) -> None:
        if not _UNIX_TIME.fullmatch(timestamp):
            raise SignatureInvalid("The webhook's timestamp is not a Unix time.")
        if abs(self.clock() - int(timestamp)) > self.tolerance:
            raise SignatureInvalid("The webhook's timestamp is outside the tolerance.")


Signed = Callable[[bytes], bool]


def standard_signature(key: bytes, msg_id: str, timestamp: str, body: bytes) -> str:
    """`v1,<base64>` as a Standard Webhooks sender computes it. A header value holds the bytes
    that arrived, any that are not UTF-8 as surrogates (aiohttp's decoding): signed as those
    bytes, so that a `webhook-id` no sender signed is refused, never an error."""
    content = f"{msg_id}.{timestamp}.".encode("utf-8", "surrogateescape") + body
    return "v1," + base64.b64encode(hmac.digest(key, content, hashlib.sha256)).decode()


def github_signature(key: bytes, body: bytes) -> str:
    return "sha256=" + hmac.digest(key, body, hashlib.sha256).hex()


def stripe_signature(key: bytes, timestamp: str, body: bytes) -> str:
    """The `v1` value of a `Stripe-Signature` header."""
    return hmac.digest(key, timestamp.encode() + b"." + body, hashlib.sha256).hex()


def _standard(headers: CIMultiDictProxy[str], body: bytes, fresh: Callable[[str], None]) -> Signed:
    msg_id = _one(headers, c.STANDARD_WEBHOOK_ID)
    timestamp = _one(headers, c.STANDARD_WEBHOOK_TIMESTAMP)
    offered = _one(headers, c.STANDARD_WEBHOOK_SIGNATURE).split(" ")
    fresh(timestamp)
    # Other versions (`v1a`, asymmetric) are not ours to check; only `v1,` entries count.
    candidates = [sig for sig in offered if sig.startswith("v1,")]
    return lambda key: _matches(standard_signature(key, msg_id, timestamp, body), candidates)


def _github(headers: CIMultiDictProxy[str], body: bytes) -> Signed:
    offered = [_one(headers, c.GITHUB_SIGNATURE)]
    return lambda key: _matches(github_signature(key, body), offered)


def _stripe(headers: CIMultiDictProxy[str], body: bytes, fresh: Callable[[str], None]) -> Signed:
    pairs = [part.partition("=") for part in _one(headers, c.STRIPE_SIGNATURE).split(",")]
    stamps = [value for name, _, value in pairs if name.strip() == "t"]
    if len(stamps) != 1:
        raise SignatureInvalid("The Stripe-Signature header names no single timestamp t.")
    timestamp = stamps[0].strip()
    fresh(timestamp)
    candidates = [value.strip() for name, _, value in pairs if name.strip() == "v1"]
    return lambda key: _matches(stripe_signature(key, timestamp, body), candidates)


def _one(headers: CIMultiDictProxy[str], name: str) -> str:
    values = headers.getall(name, [])
    if len(values) != 1 or not values[0]:
        raise SignatureInvalid(f"Send the {name} header exactly once.")
    return values[0]


def _matches(expected: str, offered: Iterable[str]) -> bool:
    wanted = expected.encode()
    found = False
    for candidate in offered:
        # Every candidate is compared, in constant time: no early exit on the first match.
        found |= hmac.compare_digest(wanted, candidate.encode("utf-8", "surrogateescape"))
    return found
