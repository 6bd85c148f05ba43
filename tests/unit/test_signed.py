"""SPEC §5: a credential signed for one request is recognised, and a stable one is not.

The signed values here are real: SigV4 from botocore's own signer, the others as their
specifications build them (tests/proxy/test_signed_owner.py sends them through the proxy)."""

from __future__ import annotations

import logging

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from multidict import CIMultiDict

from idemproxy.config.settings import OwnerSettings
from idemproxy.errors import InvalidRequest, OwnerUnstable
from idemproxy.identity.intent import (
    OwnerPolicy,
    derive_owner,
    hash_credential,
    log_owner_hint,
    per_request_signature,
)
from idemproxy.ops.purge import owners_of_credential
from tests.support.signatures import digest_authorization, hawk_authorization, message_signature
from tests.support.vendor_signatures import SIGNERS, STABLE_SIGNED_LOOKING, qbox


def sigv4(url: str = "http://127.0.0.1/bucket/object?uploads") -> CIMultiDict[str]:
    request = AWSRequest(method="POST", url=url, data=b"")
    SigV4Auth(Credentials("AKIDEXAMPLE", "secret"), "s3", "us-east-1").add_auth(request)
    return CIMultiDict(request.headers.items())


SIGNED = {
    "sigv4": sigv4()["Authorization"],
    "digest": digest_authorization("POST", "/orders"),
    "hawk": hawk_authorization("POST", "/orders"),
    "oauth1": 'OAuth oauth_consumer_key="k", oauth_nonce="n", oauth_signature="s"',
    "cavage": 'Signature keyId="k",algorithm="hmac-sha256",signature="c2ln"',
    "sigv2": "AWS AKIDEXAMPLE:frJIUN8DYpKDtOLCwo//yllqDzg=",
    "azure": "SharedKey account:c2lnbmF0dXJl",
    "edgegrid": "EG1-HMAC-SHA256 client_token=a;access_token=b;timestamp=t;nonce=n;signature=s",
    "mac-params": 'MAC id="h480djs93hd8", ts="1336363200", nonce="dj83hs9s", mac="bhCQ="',
    "negotiate": "Negotiate YIIJvwYGKwYBBQUCoIIJszCCCa+gJDAi",
    **{
        vendor: sign("POST", "127.0.0.1", "/orders", 1_796_533_200)["Authorization"]
        for vendor, sign in SIGNERS.items()
    },
    "qbox": qbox("/orders", b"amount=1")["Authorization"],
    "sigv4-tab": sigv4()["Authorization"].replace(", ", ",").replace(" ", "\t", 1),
    "sigv4-spaces": sigv4()["Authorization"].replace(" ", "   ", 1),
    "sharedkeylite": "SharedKeyLite account:c2lnbmF0dXJl",
    "oss": "OSS LTAIexample:c2lnbmF0dXJl",
    "tc3": "TC3-HMAC-SHA256 Credential=AKID/2026-12-06/cvm/tc3_request, SignedHeaders=host,"
    " Signature=ab12",
    "hmac-sha1": "HMAC-SHA1 Credential=a&SignedHeaders=date&Signature=c2ln",
    "ksc": "KSC AKLTexample:c2lnbmF0dXJl",
    "vendor-hmac": "SDK-HMAC-SHA256 Access=AK, SignedHeaders=host;x-sdk-date, Signature=ab12",
    "ampersand-sig": "Custom id=a&sig=c2ln",
    "upper-nonce": "Custom id=a;NONCE=n",
    "cosmos-master-plain": "type=master&ver=1.0&sig=c2lnbmF0dXJl",
    "cosmos-master-upper": "type%3Dmaster%26ver%3D1.0%26sig%3Dc2ln%2Bbg%3D%3D",
    "cosmos-master-reordered": "ver=1.0&sig=c2lnbmF0dXJl&type=master",
    "obs": "OBS AKIDEXAMPLE:c2lnbmF0dXJl",
    "acs": "acs AKIDEXAMPLE:c2lnbmF0dXJl",
    "upyun": "UPYUN operator:c2lnbmF0dXJl",
    "vws": "VWS ak:c2lnbmF0dXJl",
    "apiauth": "APIAuth 1044:c2lnbmF0dXJl",
}


@pytest.mark.parametrize("authorization", SIGNED.values(), ids=SIGNED.keys())
def test_a_per_request_signature_is_recognised(authorization: str) -> None:
    assert per_request_signature(authorization, {}) is not None


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer sk-live-4f9a1c2e7b",
        "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhIn0.c2ln",
        "Basic dXNlcjpwYXNz",
        "Token token=abc123",
        "ApiKey abc",
        "sk-live-without-a-scheme",
        "Custom key=abc, tenant=42",
        "Custom key=abc&tenant=42",
        "Bearer\tsk-live-4f9a1c2e7b",
        "DPoP eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJhIn0.c2ln",
        "Token abc123",
        "ApiKey key=abc, signature=never-looked-at",
        "Basic c2lnPXNpZw==",
        *STABLE_SIGNED_LOOKING,
    ],
)
def test_a_credential_sent_the_same_on_every_try_is_not(authorization: str) -> None:
    assert per_request_signature(authorization, {}) is None


def test_the_scheme_is_named_from_the_list_never_echoed() -> None:
    what = per_request_signature(sigv4()["Authorization"], {})
    assert what == "AWS Signature Version 4 (Authorization: AWS4-HMAC-SHA256)"
    assert "AKIDEXAMPLE" not in (what or "")


def test_a_message_signature_is_the_credential_only_without_an_authorization() -> None:
    signed = message_signature("POST", "127.0.0.1", "/orders")
    assert per_request_signature(None, signed) is not None
    assert per_request_signature("Bearer stable-token", signed) is None  # scoped by the token


@pytest.mark.parametrize(
    ("query", "signed"),
    [
        ("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=a&X-Amz-Signature=ab12", True),
        ("X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature=ab12", True),
        ("AWSAccessKeyId=AKID&Expires=1700000000&Signature=c2ln", True),
        ("q-sign-algorithm=sha1&q-ak=AK&q-sign-time=1;2&q-signature=ab12", True),
        ("signature=mine&page=2", False),  # a parameter that happens to be called so
        ("page=2", False),
        ("", False),
    ],
)
def test_a_presigned_url_is_recognised_by_its_query(query: str, signed: bool) -> None:
    assert (per_request_signature(None, {}, query) is not None) is signed


def test_the_default_owner_refuses_it_and_the_others_do_not_look() -> None:
    headers = sigv4()
    with pytest.raises(OwnerUnstable) as refused:
        derive_owner(OwnerPolicy(), headers)
    assert "header:<NAME>" in refused.value.detail and "jwt" in refused.value.detail
    # A gateway's header, or one global scope: the signature is no part of the owner.
    gateway = CIMultiDict(headers, **{"X-Tenant": "acme"})
    assert derive_owner(OwnerPolicy("header:X-Tenant"), gateway) == hash_credential("acme")
    assert derive_owner(OwnerPolicy("none"), headers) == "global"
    # The default spelled as a gateway header is the same hash, refused the same way.
    with pytest.raises(OwnerUnstable):
        derive_owner(OwnerPolicy("header:authorization"), headers)


def test_the_start_up_hint_speaks_of_signed_requests_too(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="idemproxy.owner")
    log_owner_hint(OwnerSettings())
    (hint,) = [r.getMessage() for r in caplog.records if r.name == "idemproxy.owner"]
    assert "rotating tokens" in hint and "SigV4" in hint and "owner-unstable" in hint
    caplog.clear()
    log_owner_hint(OwnerSettings(strategy="none"))
    assert not caplog.records


def test_an_operator_naming_an_owner_by_a_signature_is_told_it_names_none() -> None:
    """`idemproxy jobs purge --credential-file`: no job was ever claimed under such a
    credential, so it names no owner (and not a crash)."""
    with pytest.raises(InvalidRequest, match="signature made for one request"):
        owners_of_credential(sigv4()["Authorization"], OwnerSettings())


@pytest.mark.parametrize("vendor", ["tencent-cos", "baidu-bce"])
def test_a_credential_without_a_scheme_is_named_without_a_byte_of_it(vendor: str) -> None:
    signed = SIGNERS[vendor]("POST", "127.0.0.1", "/orders", 1_796_533_200)["Authorization"]
    what = per_request_signature(signed, {}) or ""
    assert what.startswith(("Tencent Cloud COS", "Baidu Cloud BCE"))
    assert "AKIDEXAMPLE" not in what and signed[-8:] not in what
