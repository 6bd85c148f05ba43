"""Deriving the owner scope of a request (SPEC §5). Only a hash of a credential is kept."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from idemproxy.constants import ANONYMOUS_OWNER, GLOBAL_OWNER
from idemproxy.errors import ConfigError, OwnerMissing

# RFC 9110 §5.1: field-name = token.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


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
        # The name must be an RFC 9110 token exactly: "header: X-Tenant" would look up
        # " X-Tenant", never find it, and put every request in the shared anonymous scope.
        if not self.strategy.startswith("header:") or not _TOKEN.fullmatch(self.strategy[7:]):
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
