"""Deriving the owner scope of a request (SPEC §5). Only a hash of a credential is kept."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from multidict import MultiMapping

from idemproxy.config import OwnerSettings, check_strategy
from idemproxy.constants import ANONYMOUS_OWNER, GLOBAL_OWNER
from idemproxy.errors import ConfigError, HeaderInvalid, OwnerMissing
from idemproxy.identity.jwt_keys import FetchObserver, KeySource, unobserved
from idemproxy.identity.jwt_owner import JwtVerifier

log = logging.getLogger("idemproxy.owner")

# SPEC §5: the default scope is a hash of the whole header, so a new token is a new scope.
AUTHORIZATION_OWNER_HINT = (
    "owner.strategy is authorization: jobs are scoped by a hash of the whole Authorization"
    " header, so a client whose token is refreshed between a request and its retry lands in a"
    " new scope and the retry executes again; with rotating tokens (OAuth, OIDC) use"
    " owner.strategy jwt or header:<NAME> set by a gateway"
)


def log_owner_hint(settings: OwnerSettings) -> None:
    """Once at start-up (SPEC §5): what the default owner strategy means for rotating tokens."""
    if settings.strategy == "authorization":
        log.info("%s", AUTHORIZATION_OWNER_HINT)


class OwnerVerifier(Protocol):
    def owner(self, authorization: str) -> str:
        """The owner of a present credential; raises `OwnerMissing` when it does not verify
        (and `KeyNotLoaded` when its key may be fetched yet)."""
        ...

    async def start(self, observe: FetchObserver = unobserved) -> None: ...

    async def close(self) -> None: ...

    def not_ready(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class OwnerPolicy:
    """`strategy` is "authorization", "header:<name>", "jwt" (with its `verifier`) or "none"."""

    strategy: str = "authorization"
    required: bool = False
    verifier: OwnerVerifier | None = None

    def __post_init__(self) -> None:
        # An unverified "jwt" policy would hash whatever token is sent: never build one.
        if (self.strategy == "jwt") != (self.verifier is not None):
            raise ConfigError("owner.strategy jwt goes with a verifier, and only it")

    @property
    def header(self) -> str | None:
        if self.strategy in ("authorization", "jwt"):
            return "Authorization"
        if self.strategy.startswith("header:"):
            return self.strategy.removeprefix("header:")
        return None

    def validate(self) -> None:
        check_strategy(self.strategy)

    async def start(self, observe: FetchObserver = unobserved) -> None:
        """In the event loop, before the first request: an identity provider's keys are
        fetched (SPEC §5); `observe` hears how each fetch ended."""
        if self.verifier is not None:
            await self.verifier.start(observe)

    async def close(self) -> None:
        if self.verifier is not None:
            await self.verifier.close()

    def not_ready(self) -> str | None:
        """Why requests with a credential cannot be scoped yet (for /readyz); None when they
        can."""
        return None if self.verifier is None else self.verifier.not_ready()


def owner_policy(settings: OwnerSettings, keys: KeySource | None = None) -> OwnerPolicy:
    """The policy `settings` describe, built once at start-up: with `jwt`, this loads the keys,
    or takes `keys` (an identity provider's, proxy/idp/); `ConfigError` naming the field at
    fault."""
    verifier = None
    if settings.strategy == "jwt":
        verifier = JwtVerifier.from_settings(settings.jwt, keys=keys)
    return OwnerPolicy(settings.strategy, settings.required, verifier)


def derive_owner(policy: OwnerPolicy, headers: Mapping[str, str]) -> str:
    """The owner scope for a request; raises `OwnerMissing` when one is required and absent.

    With a verifier (`jwt`), a credential that is present but does not verify is 401 even when
    the owner is optional: it must never fall into the shared anonymous scope. The credential
    header sent more than once is `HeaderInvalid`, as the key is (SPEC §5).
    """
    header = policy.header
    if header is None:
        return GLOBAL_OWNER
    credential = single_value(headers, header)
    if not credential:
        if policy.required:
            raise OwnerMissing()
        return ANONYMOUS_OWNER
    if policy.verifier is not None:
        return policy.verifier.owner(credential)
    return hash_credential(credential)


def single_value(headers: Mapping[str, str], name: str) -> str | None:
    """The one value of `name`, None when absent; `HeaderInvalid` when it is repeated.

    A gateway that appends (`X-User: victim`, then `X-User: attacker`) leaves two values: taking
    the first would scope the request as someone the sender may not be, so none is believed.
    """
    if isinstance(headers, MultiMapping):
        values = headers.getall(name, [])
        if len(values) > 1:
            raise HeaderInvalid(f"Send the {name} header exactly once.")
        return values[0] if values else None
    return headers.get(name)


def hash_credential(credential: str) -> str:
    return hashlib.sha256(credential.encode("utf-8", "surrogateescape")).hexdigest()
