"""Deriving the owner scope of a request (SPEC §5). Only a hash of a credential is kept."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from idemproxy.constants import ANONYMOUS_OWNER, GLOBAL_OWNER
from idemproxy.errors import ConfigError, OwnerMissing


@dataclass(frozen=True, slots=True)
class OwnerPolicy:
    """`strategy` is "authorization", "header:<name>" or "none"."""

    strategy: str = "authorization"
    required: bool = False

    @property
    def header(self) -> str | None:
        if self.strategy == "authorization":
            return "Authorization"
        if self.strategy.startswith("header:"):
            return self.strategy.removeprefix("header:")
        return None

    def validate(self) -> None:
        if self.strategy in ("authorization", "none"):
            return
        if not self.strategy.startswith("header:") or not self.strategy[7:].strip():
            raise ConfigError("owner.strategy must be authorization, header:<NAME> or none")


def derive_owner(policy: OwnerPolicy, headers: Mapping[str, str]) -> str:
    """The owner scope for a request; raises `OwnerMissing` when one is required and absent."""
    header = policy.header
    if header is None:
        return GLOBAL_OWNER
    credential = headers.get(header)
    if not credential:
        if policy.required:
            raise OwnerMissing()
        return ANONYMOUS_OWNER
    return hash_credential(credential)


def hash_credential(credential: str) -> str:
    return hashlib.sha256(credential.encode("utf-8", "surrogateescape")).hexdigest()
