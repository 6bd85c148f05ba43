"""Credentials signed for one request, built as their specifications say (SPEC §5 tests).

Each call signs afresh (a new nonce, the current time), as a client does on every try; SigV4
comes from botocore's own signer in the tests themselves."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time

_USER, _REALM, _PASSWORD = "alice", "orders@example.com", "wonderland"


def digest_authorization(
    method: str, uri: str, nonce: str = "dcd98b7102dd2f0e8b11d0f600bfb0c093"
) -> str:
    """RFC 7616 §3.4 (MD5, qop=auth), in the form requests' HTTPDigestAuth sends: a fresh
    client nonce, so every try's `response` differs."""
    cnonce = secrets.token_hex(8)
    nc = "00000001"
    ha1 = hashlib.md5(f"{_USER}:{_REALM}:{_PASSWORD}".encode()).hexdigest()
    ha2 = hashlib.md5(f"{method}:{uri}".encode()).hexdigest()
    response = hashlib.md5(f"{ha1}:{nonce}:{nc}:{cnonce}:auth:{ha2}".encode()).hexdigest()
    return (
        f'Digest username="{_USER}", realm="{_REALM}", nonce="{nonce}", uri="{uri}", '
        f'response="{response}", algorithm="MD5", qop="auth", nc={nc}, cnonce="{cnonce}"'
    )


def hawk_authorization(method: str, resource: str, host: str = "127.0.0.1", port: int = 80) -> str:
    """Hawk's header MAC: an HMAC-SHA256 over the timestamp, a nonce, the method and the URL."""
    ts, nonce = str(int(time.time())), secrets.token_urlsafe(6)
    normalised = f"hawk.1.header\n{ts}\n{nonce}\n{method}\n{resource}\n{host}\n{port}\n\n\n"
    mac = base64.b64encode(
        hmac.digest(b"werxhqb98rpaxn39848xrunpaw3489ruxnpa98w4rxn", normalised.encode(), "sha256")
    )
    return f'Hawk id="dh37fgj492je", ts="{ts}", nonce="{nonce}", mac="{mac.decode()}"'


def message_signature(method: str, authority: str, path: str) -> dict[str, str]:
    """RFC 9421 §3.1, HMAC-SHA256 (§3.3.3): the signature base over the method, the authority
    and the path, with `created` now, so each try signs another base."""
    params = (
        f'("@method" "@authority" "@path");created={int(time.time())}'
        ';keyid="test-key-shared";alg="hmac-sha256"'
    )
    base = (
        f'"@method": {method}\n"@authority": {authority}\n"@path": {path}\n'
        f'"@signature-params": {params}'
    )
    mac = hmac.digest(b"a shared secret of the test client", base.encode(), "sha256")
    return {
        "Signature-Input": f"sig1={params}",
        "Signature": f"sig1=:{base64.b64encode(mac).decode()}:",
    }
