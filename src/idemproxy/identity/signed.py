"""Recognising a credential that is a signature made for one request (SPEC §5).

With the default owner (a hash of the whole `Authorization`), such a credential puts every try
of a request in a scope of its own: SigV4 signs `X-Amz-Date`, Digest a client nonce and count,
Hawk and OAuth 1.0a a timestamp and nonce, so a retry signed again a second later is another
owner and would execute again. Nothing in it is both stable and verified by the proxy (an
access key id is stable, but anyone can send it), so such a request is refused before any
storage call rather than scoped by a part of it.

Only the scheme's name and the names of its parameters are read, never their values: what a
refusal names comes from the fixed lists below, not from the request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final
from urllib.parse import parse_qsl, unquote

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
