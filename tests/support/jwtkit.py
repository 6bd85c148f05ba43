"""Real keys and real signed tokens for the JWT owner tests (PyJWT and cryptography, no fakes)."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from idemproxy.config.settings import JwtSettings
from idemproxy.identity.jwt_owner import JwtVerifier

AUDIENCE = "https://api.example.test"
ISSUER = "https://idp.example.test"
# 48 bytes: long enough for HS256 and HS384 (RFC 7518 §3.2).
SECRET = "k7Qp2vX9mR4tL8wZ1cN6bH3jF5dS0gY2aE7uI9oP4kM1nB8v"

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
# The environment the verifiers below read their `env:` keys from.
ENVIRON = {"JWT_SECRET": SECRET}


def verifier(key: str, algorithms: list[str], **settings: Any) -> JwtVerifier:
    """The proxy's verifier for `key` (a file, a JWKS file or `env:JWT_SECRET`) and AUDIENCE."""
    jwt_settings = JwtSettings(key=key, algorithms=algorithms, audience=[AUDIENCE], **settings)
    return JwtVerifier.from_settings(jwt_settings, environ=ENVIRON)


def hs256(**settings: Any) -> JwtVerifier:
    """A verifier of HS256 tokens signed with SECRET."""
    return verifier("env:JWT_SECRET", ["HS256"], **settings)


@functools.cache
def rsa_key(index: int = 0, bits: int = 2048) -> rsa.RSAPrivateKey:
    """A cached RSA key pair; `index` tells different keys apart."""
    del index
    return rsa.generate_private_key(public_exponent=65537, key_size=bits)


@functools.cache
def ec_key(index: int = 0, curve: str = "P-256") -> ec.EllipticCurvePrivateKey:
    del index
    curves = {"P-256": ec.SECP256R1(), "P-384": ec.SECP384R1(), "P-521": ec.SECP521R1()}
    return ec.generate_private_key(curves[curve])


def public_pem(private: PrivateKey) -> bytes:
    return private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def private_pem(private: PrivateKey) -> bytes:
    return private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_pem(path: Path, private: PrivateKey) -> Path:
    path.write_bytes(public_pem(private))
    return path


def public_jwk(private: PrivateKey, kid: str | None = None, **members: Any) -> dict[str, Any]:
    public = private.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        jwk = RSAAlgorithm.to_jwk(public, as_dict=True)
    else:
        jwk = ECAlgorithm.to_jwk(public, as_dict=True)
    if kid is not None:
        jwk["kid"] = kid
    return {**jwk, **members}


def write_jwks(path: Path, *keys: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"keys": list(keys)}))
    return path


def claims(
    sub: Any = "alice", *, lifetime: float = 300, issued: float = 0, **extra: Any
) -> dict[str, Any]:
    """Claims for this service: `aud`, `iss`, and `exp` `lifetime` seconds after `iat`."""
    now = int(time.time() + issued)
    return {"sub": sub, "aud": AUDIENCE, "iss": ISSUER, "iat": now, "exp": now + lifetime, **extra}


def token(
    payload: dict[str, Any], key: PrivateKey | str | bytes, algorithm: str, kid: str | None = None
) -> str:
    headers = {"kid": kid} if kid is not None else None
    return jwt.encode(payload, key, algorithm=algorithm, headers=headers)


def unsigned(payload: dict[str, Any], alg: str = "none") -> str:
    """An `alg: none` token (RFC 7519 §6): no signature at all."""
    header = _b64(json.dumps({"alg": alg, "typ": "JWT"}).encode())
    return f"{header}.{_b64(json.dumps(payload).encode())}."


def hmac_token(payload: dict[str, Any], secret: bytes) -> str:
    """An HS256 token signed by hand, with any bytes as the secret (PyJWT refuses PEM bytes)."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    signing_input = f"{header}.{_b64(json.dumps(payload).encode())}"
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(signature)}"


def with_payload(signed: str, payload: dict[str, Any]) -> str:
    """`signed` with its payload swapped for another: the signature no longer matches."""
    header, _, signature = signed.split(".")
    return f"{header}.{_b64(json.dumps(payload).encode())}.{signature}"


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
