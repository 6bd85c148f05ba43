"""Deriving the owner scope of a request (SPEC §5). Only a hash of a credential is kept: its
SHA-256 (or, for a JWT, of its verified claim), and with `owner.pepper` set, the HMAC-SHA256 of
that under the pepper, which a database dump alone does not let anyone recompute.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol
from urllib.parse import parse_qsl, unquote, unquote_plus

from multidict import CIMultiDict, CIMultiDictProxy, MultiMapping

from idemproxy.config.settings import OwnerSettings, check_strategy
from idemproxy.constants import ANONYMOUS_OWNER, GLOBAL_OWNER
from idemproxy.errors import ConfigError, HeaderInvalid, OwnerMissing, OwnerUnstable
from idemproxy.identity.jwt_keys import FetchObserver, KeySource, unobserved
from idemproxy.identity.jwt_owner import JwtVerifier

# Recognising a credential that is a signature made for one request (SPEC §5).
#
# With the default owner (a hash of the whole `Authorization`), such a credential puts every try
# of a request in a scope of its own: SigV4 signs `X-Amz-Date`, Digest a client nonce and count,
# Hawk and OAuth 1.0a a timestamp and nonce, so a retry signed again a second later is another
# owner and would execute again. Nothing in it is both stable and verified by the proxy (an
# access key id is stable, but anyone can send it), so such a request is refused before any
# storage call rather than scoped by a part of it.
#
# Only the scheme's name and the names of its parameters are read, never their values: what a
# refusal names comes from the fixed lists below, not from the request.


# RFC 9110 §11.4: `Authorization: <auth-scheme> [ token68 / #auth-param ]`. The schemes whose
# credentials are computed afresh for each request, by the name their specifications give them.
_SIGNED_SCHEMES: Final = {
    "aws4-hmac-sha256": "AWS Signature Version 4",
    "aws4-ecdsa-p256-sha256": "AWS Signature Version 4A",
    "aws": "AWS Signature Version 2",
    "goog4-hmac-sha256": "Google Cloud Storage V4 signature",
    "goog4-rsa-sha256": "Google Cloud Storage V4 signature",
    "goog1": "Google Cloud Storage HMAC signature",
    "oss": "Alibaba Cloud OSS signature",
    "oss4-hmac-sha256": "Alibaba Cloud OSS V4 signature",
    "tc3-hmac-sha256": "Tencent Cloud TC3 signature",
    "sharedkey": "Azure Storage Shared Key",
    "sharedkeylite": "Azure Storage Shared Key Lite",
    "hmac-sha256": "HMAC-SHA256 request signature (Azure, Volcengine)",
    "hmac-sha1": "HMAC-SHA1 request signature",
    "qiniu": "Qiniu signature",
    "qbox": "Qiniu QBox signature",
    "ksc": "Kingsoft Cloud signature",
    "kss": "Kingsoft Cloud KS3 signature",
    "eg1-hmac-sha256": "Akamai EdgeGrid",
    "digest": "HTTP Digest (RFC 7616)",
    "hawk": "Hawk",
    "oauth": "OAuth 1.0a (RFC 5849)",
    "signature": "HTTP Signatures (draft-cavage)",
    "hoba": "HOBA (RFC 7486)",
    "scram-sha-1": "SCRAM (RFC 7804)",
    "scram-sha-256": "SCRAM (RFC 7804)",
    "negotiate": "Negotiate (Kerberos, RFC 4559)",
    "ntlm": "NTLM",
    "obs": "Huawei Cloud OBS signature",
    "acs": "Alibaba Cloud ROA signature",
    "upyun": "UPYUN signature",
    "vws": "Vuforia Web Services signature",
    "apiauth": "api-auth HMAC signature",
}
# Credentials with no scheme before their first space, known by how they begin (the rest is
# the signature, never echoed): Baidu's BCE and Tencent COS's.
_SIGNED_PREFIXES: Final = {
    "bce-auth-v1/": "Baidu Cloud BCE signature (bce-auth-v1)",
    "q-sign-algorithm=": "Tencent Cloud COS signature (q-sign-algorithm)",
}
# Schemes whose credential is a token sent unchanged on every try: never second-guessed. An
# Azure Service Bus, Event Hubs or IoT Hub SAS token signs its resource and expiry (`sr`,
# `se`): the same token is sent until it expires, though it holds a `sig`.
_STABLE_SCHEMES: Final = frozenset(
    {"bearer", "basic", "token", "apikey", "api-key", "dpop", "sharedaccesssignature"}
)
# An auth-param with one of these names makes any other scheme a per-request signature (a MAC
# or a nonce: OAuth's MAC draft, vendors' HMAC schemes), wherever it is in the credential and
# whichever of the separators vendors use comes before it. A time alone (`date`, `ts`) does
# not: an API key may hold one, and a signature of a time has a MAC beside it.
_SIGNED_PARAM: Final = re.compile(
    r"(?:^|[\s,;&])(?:signature|q-signature|sig|mac|nonce|cnonce|oauth_signature|oauth_nonce)"
    r"\s*=",
    re.IGNORECASE,
)
# Azure Cosmos DB: `type={master|resource|aad}&ver=1.0&sig=…`, URL-encoded as its
# documentation requires or not. Only a master key's signs the request (its verb, resource
# and `x-ms-date`); a resource token or an Entra ID token is the same on every try.
_COSMOS_PARAMS: Final = frozenset({"type", "ver", "sig"})
# RFC 9421 §4: a message signature travels in these two fields, whatever else authenticates.
_MESSAGE_SIGNATURE: Final = ("Signature-Input", "Signature")
# Query parameters of a presigned URL: its signature is in the URL (SigV4 §"query string
# authentication", SigV2, GCS V4, Tencent COS).
_PRESIGNED: Final = {
    "x-amz-signature": "an AWS SigV4 presigned URL (X-Amz-Signature)",
    "x-goog-signature": "a Google Cloud Storage presigned URL (X-Goog-Signature)",
    "q-signature": "a Tencent Cloud COS presigned URL (q-signature)",
    "signature": "a presigned URL (Signature)",
}


def per_request_signature(
    authorization: str | None, headers: Mapping[str, str], raw_query: str = ""
) -> str | None:
    """What makes this request's credential a signature for this request alone, in words for
    a problem's detail; None when its credential is one that every try sends the same.

    With an `Authorization`, only it counts: a stable token next to an RFC 9421 signature
    scopes the request by that token. Without one, a message signature or a presigned URL is
    the credential, and neither is anything the proxy verified."""
    if authorization:
        return _signed_scheme(authorization)
    signature_input, signature = _MESSAGE_SIGNATURE
    if signature_input in headers and signature in headers:
        return "HTTP Message Signatures (RFC 9421: Signature-Input, Signature)"
    # The common case, a query without any signature, costs one case-insensitive search.
    if "signature" not in raw_query.lower():
        return None
    return _presigned(raw_query)


def _signed_scheme(authorization: str) -> str | None:
    credential = authorization.strip()
    lowered = credential.lower()
    for prefix, vendor in _SIGNED_PREFIXES.items():
        if lowered.startswith(prefix):
            return vendor
    cosmos = _cosmos_type(credential)
    if cosmos is not None:
        return "Azure Cosmos DB master key signature (type=master)" if cosmos == "master" else None
    # RFC 9110 §11.4 puts one space after the scheme; clients send tabs and more as well.
    scheme = (lowered.split(None, 1) or [""])[0]
    named = _SIGNED_SCHEMES.get(scheme)
    if named is not None:
        return f"{named} (Authorization: {scheme.upper()})"
    if scheme in _STABLE_SCHEMES:
        return None
    if "hmac" in scheme and "=" not in scheme:
        # A scheme named after its MAC (`SDK-HMAC-SHA256`, `ACS3-HMAC-SHA256`): a vendor's
        # request signature; the name is one scheme token, but it comes from the request.
        return "an Authorization scheme named after an HMAC"
    return _generic(credential)


def _cosmos_type(credential: str) -> str | None:
    """The `type` of an Azure Cosmos DB token (one token: no scheme, no whitespace, its
    three parameters in any order); None for any other credential."""
    if "type" not in credential.lower() or any(c.isspace() for c in credential):
        return None
    params = {name.lower(): value for name, value in parse_qsl(unquote(credential))}
    if not _COSMOS_PARAMS.issubset(params):
        return None
    return params["type"].strip().lower()


def _generic(credential: str) -> str | None:
    if _SIGNED_PARAM.search(credential) is None:
        return None
    return "an Authorization scheme that signs with a MAC or a nonce"


def _presigned(raw_query: str) -> str | None:
    names = {name.lower() for name, _ in parse_qsl(raw_query, keep_blank_values=True)}
    if "signature" in names and not names & {"expires", "awsaccesskeyid"}:
        names.discard("signature")  # a `signature` that is not a presigned URL's
    for name, what in _PRESIGNED.items():
        if name in names:
            return what
    return None


log = logging.getLogger("idemproxy.owner")

# SPEC §5: the default scope is a hash of the whole header, so a new token is a new scope.
AUTHORIZATION_OWNER_HINT = (
    "owner.strategy is authorization: jobs are scoped by a hash of the whole Authorization"
    " header, so a client whose token is refreshed between a request and its retry lands in a"
    " new scope and the retry executes again; with rotating tokens (OAuth, OIDC) use"
    " owner.strategy jwt or header:<NAME> set by a gateway. A credential signed afresh for"
    " every request (AWS SigV4, HTTP Message Signatures, Digest, Hawk, OAuth 1.0a, a presigned"
    " URL) would make every try a new scope: such governed requests are refused (400"
    " owner-unstable); for those clients use header:<NAME> set by a gateway that verified the"
    " signature, or none for a single tenant"
)
_UNSTABLE = (
    "The request's credential, {what}, is a signature made for this request alone: a retry"
    " signed again would be another owner and could execute again. Nothing was claimed or"
    " forwarded. The proxy needs an owner that stays the same on every try: owner.strategy"
    " header:<NAME> (set by a gateway that verified the signature), jwt, or none."
)


def log_owner_hint(settings: OwnerSettings) -> None:
    """Once at start-up (SPEC §5): what the default owner strategy means for rotating tokens
    and for credentials signed per request."""
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
    """`strategy` is "authorization", "header:<name>", "jwt" (with its `verifier`) or "none".

    `pepper`: owners are the HMAC-SHA256 of the credential's hash under it (SPEC §5).
    `legacy_owners`: the transition window to the pepper, when a job may still be under the
    owner the credential had without it (`derive_owners`)."""

    strategy: str = "authorization"
    required: bool = False
    verifier: OwnerVerifier | None = None
    pepper: bytes | None = None
    legacy_owners: bool = False
    # HMAC keyed once with the pepper, copied per request: a third of `hmac.new`'s cost.
    _keyed: hmac.HMAC | None = field(default=None, init=False, repr=False, compare=False)
    # The owner is a hash of the Authorization as sent (`authorization`, or `header:` naming
    # it): a signature made for one request would be an owner for one try (SPEC §5).
    _hashes_authorization: bool = field(default=False, init=False, repr=False, compare=False)
    # The header the owner comes from (None: every request is the global owner), from
    # `strategy`: read two or three times per governed request, so worked out once.
    header: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # An unverified "jwt" policy would hash whatever token is sent: never build one.
        if (self.strategy == "jwt") != (self.verifier is not None):
            raise ConfigError("owner.strategy jwt goes with a verifier, and only it")
        if self.legacy_owners and self.pepper is None:
            raise ConfigError("owner.legacy_owners is the transition to owner.pepper: set both")
        object.__setattr__(self, "header", _header_of(self.strategy))
        if self.pepper is not None:
            object.__setattr__(self, "_keyed", hmac.new(self.pepper, digestmod=hashlib.sha256))
        hashed = self.verifier is None and (self.header or "").lower() == "authorization"
        object.__setattr__(self, "_hashes_authorization", hashed)

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
    pepper = None
    if settings.pepper is not None:
        pepper = settings.pepper.get_secret_value().encode("utf-8", "surrogateescape")
    return OwnerPolicy(
        settings.strategy, settings.required, verifier, pepper, settings.legacy_owners
    )


def derive_owner(policy: OwnerPolicy, headers: Mapping[str, str], raw_query: str = "") -> str:
    """The owner scope for a request; raises `OwnerMissing` when one is required and absent.

    With a verifier (`jwt`), a credential that is present but does not verify is 401 even when
    the owner is optional: it must never fall into the shared anonymous scope. The credential
    header sent more than once is `HeaderInvalid`, as the key is (SPEC §5). When the owner is
    a hash of the Authorization header, a credential signed for this request alone
    (`raw_query` holds a presigned URL's) is `OwnerUnstable`: each try would be an owner.
    """
    return derive_owners(policy, headers, raw_query)[0]


def _header_of(strategy: str) -> str | None:
    if strategy in ("authorization", "jwt"):
        return "Authorization"
    if strategy.startswith("header:"):
        return strategy.removeprefix("header:")
    return None


def derive_owners(
    policy: OwnerPolicy, headers: Mapping[str, str], raw_query: str = ""
) -> tuple[str, str | None]:
    """`derive_owner`'s owner, and with `legacy_owners` the owner the same credential had
    before the pepper (plain SHA-256), under which a job may still be (SPEC §5); else None.
    The shared scopes (anonymous, global) are the same with and without a pepper."""
    header = policy.header
    if header is None:
        return GLOBAL_OWNER, None
    if isinstance(headers, MultiMapping):  # `single_value`, in place: every governed request
        values = headers.getall(header, [])
        if len(values) > 1:
            raise HeaderInvalid(f"Send the {header} header exactly once.")
        credential = values[0] if values else None
    else:
        credential = headers.get(header)
    if policy._hashes_authorization:
        # SPEC §5: the hash of a signature made for one try is a scope for that try alone.
        what = per_request_signature(credential, headers, raw_query)
        if what is not None:
            raise OwnerUnstable(_UNSTABLE.format(what=what))
    if not credential:
        if policy.required:
            raise OwnerMissing()
        # SPEC §5: the anonymous scope is every such caller's: one whose credential is where
        # the strategy does not look would be handed the others' replays.
        elsewhere = credential_elsewhere(headers, raw_query, header)
        if elsewhere is not None:
            raise OwnerMissing(_ELSEWHERE.format(where=elsewhere, header=header))
        return ANONYMOUS_OWNER, None
    if policy.verifier is not None:
        plain = policy.verifier.owner(credential)
    else:
        plain = hash_credential(credential)
    keyed = policy._keyed
    if keyed is None:
        return plain, None
    # RFC 2104: HMAC-SHA256 of the plain owner under the pepper, hex like it.
    mac = keyed.copy()
    mac.update(plain.encode("ascii"))
    return mac.hexdigest(), plain if policy.legacy_owners else None


# Where APIs take a caller's credential (RFC 6265 cookies, RFC 6750 §2.3's query token, the
# API-key headers of the common gateways and SDKs), lower-cased.
_CREDENTIAL_HEADERS = (
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-api-key",
    "x-api-token",
    "x-token",
    "api-key",
    "apikey",
    "x-goog-api-key",
    "x-auth-token",
    "x-access-token",
    "private-token",
    "ocp-apim-subscription-key",
    "x-functions-key",
)
_CREDENTIAL_QUERY = frozenset(
    {"access_token", "api_key", "apikey", "api-key", "auth_token", "key", "token"}
)
_ELSEWHERE = (
    "This request carries a credential in {where}, which the owner strategy does not read"
    " (it reads {header}): its job would be in the anonymous scope every such caller shares,"
    " and replayed to any of them. Set owner.strategy to header:<NAME> (the header your"
    " credential or your gateway's verified identity is in), jwt, or none for a single tenant."
)


def credential_elsewhere(
    headers: Mapping[str, str], raw_query: str, strategy_header: str
) -> str | None:
    """Where a request without the strategy's credential carries one anyway (a header's name,
    or `the query`), or None."""
    if not isinstance(headers, CIMultiDictProxy | CIMultiDict):  # a plain mapping (tests, CLI)
        headers = CIMultiDict(headers)
    skip = strategy_header.lower()
    for name in _CREDENTIAL_HEADERS:
        if name == skip:
            continue
        # Every value: an empty first one beside a credential hid it from `get`. Loops, not
        # a generator: that would be a call per header name, on every anonymous request.
        for value in headers.getall(name, ()):
            if value.strip():
                return name.title() if name != "apikey" else name
    if raw_query and _names_a_credential(raw_query):
        return "the query"
    return None


def _names_a_credential(raw_query: str) -> bool:
    """Whether a parameter of the query is named as a credential, its name decoded as the
    backend decodes it (`access%5Ftoken` is `access_token`)."""
    for pair in raw_query.replace(";", "&").split("&"):
        name, _, value = pair.partition("=")
        if "%" in name or "+" in name:
            name = unquote_plus(name)
        if value and name.strip().lower() in _CREDENTIAL_QUERY:
            return True
    return False


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
    """The plain SHA-256 owner of a credential: the owner without a pepper."""
    return hashlib.sha256(credential.encode("utf-8", "surrogateescape")).hexdigest()


def owner_of_credential(policy: OwnerPolicy, credential: str) -> str:
    """The owner a request sending `credential` in the policy's header is scoped by (for an
    operator naming an owner by its credential)."""
    header = policy.header or "Authorization"
    return derive_owner(policy, {header: credential})
