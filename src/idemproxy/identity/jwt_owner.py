"""The `jwt` owner strategy (SPEC §5): the owner is a claim of a verified bearer JWT.

`Authorization: Bearer <jwt>` is verified with the configured key and algorithms (never the
algorithm a token asks for alone), then its expiry (`exp`, required), not-before, audience
(required) and, when configured, issuer, with a small leeway for clock skew. The owner is a hash
of the token's issuer and the configured claim (default `sub`), so a refreshed token for the
same subject keeps its jobs, while the token itself is never stored.

A credential that is present but does not verify is always `401 owner-missing`, even when
`owner.required` is false: in the shared anonymous scope a forged token would read anonymous
responses and seem to work. Only a request with no Authorization header at all is anonymous.

With keys from an identity provider, a token whose `kid` is in none of the keys held may be
signed with a key rotated in since they were fetched: verifying raises `KeyNotLoaded`, whose
wait the request handler awaits (a refresh, rate-limited and bounded) before verifying again.
Only that path awaits; a token with a known kid is verified at once, without I/O.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jwt

from idemproxy.config.secret_files import read_secret
from idemproxy.config.settings import JwtSettings
from idemproxy.errors import ConfigError, OwnerMissing
from idemproxy.identity.jwt_keys import (
    SECRET_FILE_FIELD,
    FetchObserver,
    KeySource,
    Refresh,
    load_keys,
    unobserved,
)

log = logging.getLogger("idemproxy.identity.owner")

# RFC 6750 §2.1: b64token. Anything else (spaces, non-ASCII, undecodable bytes) is no JWT.
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")

# RFC 9110 §5.5: a field value never holds NUL, so no header hash can start from this prefix.
_CLAIM_NAMESPACE = "\0idemproxy:jwt\0"

_NOT_BEARER = "The Authorization header must carry a bearer JWT (Authorization: Bearer <token>)."
UNVERIFIED = "The bearer token could not be verified."
_NO_OWNER = "The bearer token does not carry the owner claim as a non-empty string."
# Fixed details by failure, never PyJWT's message or any byte of the token (SPEC §8).
_REASONS: tuple[tuple[type[jwt.PyJWTError], str], ...] = (
    (jwt.ExpiredSignatureError, "The bearer token has expired."),
    (jwt.ImmatureSignatureError, "The bearer token is not valid yet."),
    (jwt.InvalidAudienceError, "The bearer token is meant for another audience."),
    (jwt.InvalidIssuerError, "The bearer token comes from another issuer."),
    (jwt.MissingRequiredClaimError, "The bearer token lacks a required claim."),
)


class KeyNotLoaded(Exception):  # a signal to the request handler, never an answer
    """The token's kid is in none of the keys held, and fetching them again may find it."""

    def __init__(self, wait: Refresh) -> None:
        super().__init__("the token's key is not loaded")
        self.wait = wait


@dataclass(frozen=True, slots=True)
class JwtVerifier:
    """Verifies bearer JWTs and turns the owner claim into an owner scope (an `OwnerVerifier`)."""

    keys: KeySource
    audience: tuple[str, ...]
    issuer: str | None = None
    claim: str = "sub"
    leeway: float = 0.0
    # The configured algorithms: a token asking for another is refused without a key refresh.
    algorithms: tuple[str, ...] = ()

    @classmethod
    def from_settings(
        cls,
        settings: JwtSettings,
        environ: Mapping[str, str] | None = None,
        keys: KeySource | None = None,
    ) -> JwtVerifier:
        """Load the keys once (start-up), or use `keys` (an identity provider's, fetched by
        proxy/idp/); raises `ConfigError` naming the field at fault."""
        if keys is None:
            keys = _local_keys(settings, os.environ if environ is None else environ)
        return cls(
            keys=keys,
            audience=tuple(settings.audience),
            issuer=settings.issuer,
            claim=settings.claim,
            leeway=settings.leeway,
            algorithms=tuple(settings.algorithms),
        )

    def owner(self, authorization: str) -> str:
        claims = self.verify(_bearer_token(authorization))
        value = claims.get(self.claim)
        if not isinstance(value, str) or not value:
            raise OwnerMissing(_NO_OWNER)
        return hash_claim(claims.get("iss"), self.claim, value)

    async def start(self, observe: FetchObserver = unobserved) -> None:
        await self.keys.start(observe)

    async def close(self) -> None:
        await self.keys.close()

    def not_ready(self) -> str | None:
        return self.keys.not_ready()

    def verify(self, token: str) -> dict[str, Any]:
        """The claims of a token that verifies; raises `OwnerMissing` for any other, and
        `KeyNotLoaded` when its key may be fetched yet."""
        try:
            header = jwt.get_unverified_header(token)
            kid = header.get("kid")
            key = self.keys.select(kid)
            if key is None:
                # No fetch for a token no key of the provider's could verify anyway.
                fits = header.get("alg") in self.algorithms
                refresh = self.keys.refresh_for(kid, self._signed_by(token)) if fits else None
                if refresh is not None:
                    raise KeyNotLoaded(refresh)
                raise jwt.InvalidKeyError("no key for this kid")
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=key.algorithms,
                audience=self.audience,
                issuer=self.issuer,
                leeway=self.leeway,
                options={"require": ["exp"], "enforce_minimum_key_length": True},
            )
        except jwt.PyJWTError as exc:
            log.debug("bearer token rejected: %s", type(exc).__name__)
            raise OwnerMissing(_reason(exc)) from exc
        return claims

    def _signed_by(self, token: str) -> float | None:
        """When the token was surely signed, by this host's clock: its (unverified) `iat` plus
        the leeway for the clocks' difference; None without a usable `iat`. Only decides
        whether keys held are new enough to call its kid unknown (SPEC §5): a forged `iat`
        buys a forged token nothing but a 503 instead of a 401."""
        try:
            issued = jwt.decode(token, options={"verify_signature": False}).get("iat")
        except jwt.PyJWTError:
            return None
        if isinstance(issued, bool) or not isinstance(issued, int | float):
            return None
        try:
            signed_by = float(issued) + self.leeway
        except OverflowError:  # an integer too large for a float
            return None
        return signed_by if math.isfinite(signed_by) else None


def _local_keys(settings: JwtSettings, environ: Mapping[str, str]) -> KeySource:
    if settings.remote:
        # proxy/idp/ builds the fetching key source; identity does no I/O of its own.
        raise ConfigError("owner.jwt.jwks_uri and discovery need the identity provider's client")
    secret = None
    if settings.secret_file is not None:
        secret = read_secret(settings.secret_file, SECRET_FILE_FIELD)
    return load_keys(settings.key or "", settings.algorithms, environ, secret)


def hash_claim(issuer: object, claim: str, value: str) -> str:
    """The owner for a verified JWT claim: never equal to the hash of any header value.

    The issuer is part of it (OIDC Core §2: `sub` is unique only within its issuer). JSON with
    ASCII escapes encodes the three parts without ambiguity, lone surrogates included.
    """
    parts = json.dumps([issuer, claim, value], ensure_ascii=True, sort_keys=True)
    return hashlib.sha256((_CLAIM_NAMESPACE + parts).encode("ascii")).hexdigest()


def _bearer_token(authorization: str) -> str:
    # RFC 6750 §2.1, RFC 9110 §11.4: the auth-scheme is case-insensitive.
    scheme, _, token = authorization.partition(" ")
    token = token.strip(" ")
    if scheme.lower() != "bearer" or not _B64TOKEN.fullmatch(token):
        raise OwnerMissing(_NOT_BEARER)
    return token


def _reason(error: jwt.PyJWTError) -> str:
    for kind, reason in _REASONS:
        if isinstance(error, kind):
            return reason
    return UNVERIFIED
