"""Settings of where a route finds its key (`routes[].key`) and of webhook routes
(`routes[].webhook`), SPEC §4.1, §4.2.

Part of the settings model of `config/settings.py`. Webhook secrets are read while the settings are
validated (`env:NAME`, `file:PATH`, as `upstream_headers` values are), so that a missing one
stops the start with the field's name, never with the value.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from idemproxy import constants as c
from idemproxy.config.units import Duration
from idemproxy.config.upstream import read_value

_STRICT = ConfigDict(extra="forbid")
# RFC 9110 §5.1: a field name is a token.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A sender's name is part of its owner scope (`webhook:<sender>`), shown by `jobs list`.
_SENDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
# RFC 6901 §3: `~` is escaped as `~0` or `~1`, and nothing else.
_BAD_ESCAPE = re.compile(r"~(?![01])")
WebhookScheme = Literal["standard", "github", "stripe"]
# Fields that carry no intent of the client's: hop-by-hop and framing fields, which the proxy
# frames itself (every chunked request would share the key `chunked`), the hops' fields it
# writes or believes only from a trusted proxy (behind one, every request of a client address
# would share a key), trace context, and the proxy's own `Idempotency-*` fields, which it sets
# for the backend or answers with (SPEC §4.1, §10).
_NOT_KEYS = frozenset(
    {
        *c.HOP_BY_HOP_HEADERS,
        *c.FORWARDING_HEADERS,
        "x-real-ip",
        "via",
        "traceparent",
        "tracestate",
        "host",
        "content-length",
        "expect",
        *(
            name.lower()
            for name in (
                c.JOB_HEADER,
                c.ATTEMPT_HEADER,
                c.REPLAYED_HEADER,
                c.REPLAY_OMITTED_HEADER,
                c.ERROR_HEADER,
            )
        ),
    }
)


def key_header_name(name: str) -> str:
    """`name` as the header a key is read from: a field name (a blank or a line break is none,
    and no request would carry a key), and one that carries the client's intent."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(f"{name!r} is not a header name")
    if name.lower() in _NOT_KEYS:
        raise ValueError(
            f"{name!r} cannot carry a key: the proxy frames or sets it itself (SPEC §4.1)"
        )
    return name


class KeySourceSettings(BaseModel):
    """Where the key comes from (SPEC §4.1): one named header, or a JSON Pointer (RFC 6901)
    into the JSON body; `prefix` is put before the value found."""

    model_config = _STRICT
    header: str | None = None
    pointer: str | None = None
    prefix: str = Field(default="", max_length=64)

    @field_validator("header")
    @classmethod
    def _header_name(cls, name: str | None) -> str | None:
        return None if name is None else key_header_name(name)

    @field_validator("pointer")
    @classmethod
    def _json_pointer(cls, pointer: str | None) -> str | None:
        if pointer is None:
            return None
        if not pointer.startswith("/") or _BAD_ESCAPE.search(pointer):
            raise ValueError("must be a JSON Pointer (RFC 6901) such as /id or /data/object/id")
        return pointer

    @field_validator("prefix")
    @classmethod
    def _visible(cls, prefix: str) -> str:
        if any(not "\x21" <= ch <= "\x7e" for ch in prefix):
            raise ValueError("may contain visible ASCII characters only (SPEC §4)")
        return prefix

    @model_validator(mode="after")
    def _one_source(self) -> KeySourceSettings:
        if self.header is not None and self.pointer is not None:
            raise ValueError("give header or pointer, not both")
        return self


class WebhookSettings(BaseModel):
    """A webhook receiver (SPEC §4.2): each delivery's signature is verified with one of
    `secrets` before anything is claimed, and its jobs belong to the owner `webhook:<sender>`.

    Each secret is `env:NAME` or `file:PATH`; several are tried in turn, so that a sender's
    secret can be rotated without a window where its deliveries are refused.
    """

    model_config = _STRICT
    scheme: WebhookScheme
    sender: str
    secrets: list[str] = Field(min_length=1)
    # How far a signed timestamp may be from the proxy's clock (standard, stripe), seconds.
    tolerance: Duration = Field(default=c.DEFAULT_WEBHOOK_TOLERANCE_SECONDS, gt=0)
    _keys: tuple[bytes, ...] = PrivateAttr(default=())

    @field_validator("sender")
    @classmethod
    def _sender_name(cls, sender: str) -> str:
        if not _SENDER.fullmatch(sender):
            raise ValueError("must be 1-63 letters, digits, '.', '_' or '-' (a name, not a secret)")
        return sender

    @field_validator("secrets")
    @classmethod
    def _from_env_or_file(cls, secrets: list[str]) -> list[str]:
        for secret in secrets:
            if not secret.startswith(("env:", "file:")):
                raise ValueError("each secret is env:NAME or file:PATH, never the secret itself")
        return secrets

    @model_validator(mode="after")
    def _read_keys(self) -> WebhookSettings:
        self._keys = tuple(
            _key(self.scheme, read_value(f"secrets[{n}]", source))
            for n, source in enumerate(self.secrets)
        )
        return self

    @property
    def keys(self) -> tuple[bytes, ...]:
        """The HMAC keys, read (at start-up, once) and decoded as the scheme says."""
        return self._keys

    @property
    def default_key_source(self) -> KeySourceSettings:
        """Where each scheme's senders name the event: the header or body field that stays the
        same on every redelivery."""
        if self.scheme == "standard":
            return KeySourceSettings(header=c.STANDARD_WEBHOOK_ID)
        if self.scheme == "github":
            return KeySourceSettings(header=c.GITHUB_DELIVERY)
        return KeySourceSettings(pointer="/id")


def check_one_route_per_sender(routes: Sequence[tuple[str, WebhookSettings | None]]) -> None:
    """SPEC §4.2: a sender's jobs are the scope `webhook:<sender>`. Stripe sends one event to
    every endpoint subscribed to it, under one id: two routes of one sender would share its
    jobs, and the second route's deliveries would be `409 payload-mismatch` for ever (the
    fingerprint covers the path). `routes` is each route's prefix and webhook, in order."""
    first: dict[str, int] = {}
    for n, (prefix, webhook) in enumerate(routes):
        if webhook is None:
            continue
        seen = first.setdefault(webhook.sender, n)
        if seen != n:
            raise ValueError(
                f"routes[{seen}] ({routes[seen][0]}) and routes[{n}] ({prefix}) both have"
                f" webhook sender {webhook.sender!r}: give each webhook route a sender of its"
                " own (the sender is the scope of the route's jobs)"
            )


def _key(scheme: WebhookScheme, secret: str) -> bytes:
    """Standard Webhooks: the base64 after `whsec_` is the key. GitHub and Stripe use the
    secret's own bytes (Stripe's secrets also start with `whsec_`, and are not decoded)."""
    if scheme != "standard":
        return secret.encode("utf-8")
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except binascii.Error as exc:
        raise ValueError("a Standard Webhooks secret is whsec_ and base64") from exc
    if not key:
        raise ValueError("a Standard Webhooks secret is whsec_ and base64, and not empty")
    return key
