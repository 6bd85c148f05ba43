"""The keys that verify owner JWTs (SPEC §5), loaded once at start-up.

`owner.jwt.key` is a PEM public key or certificate file, a JWKS file (keys chosen by `kid`), or
`env:NAME`: an HMAC secret in that environment variable, so that it never sits on a command
line. Keys an identity provider publishes (`owner.jwt.jwks_uri`, `discovery`) are fetched by
proxy/idp/ and parsed here (`parse_jwks`), as a JWKS file is; both are a `KeySource`.

Each key is bound to the configured algorithms that fit its type, and a token can only be
verified with one of those: an HS256 token "signed" with an RSA public key's PEM bytes
(algorithm confusion) finds no key that accepts HS256.

Every error names the setting at fault and never echoes a value that might be a secret.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jwt
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
from cryptography.hazmat.primitives.asymmetric.ed448 import Ed448PublicKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from jwt.algorithms import HMACAlgorithm

from idemproxy import constants as c
from idemproxy.errors import ConfigError

PublicKey = RSAPublicKey | EllipticCurvePublicKey | Ed25519PublicKey | Ed448PublicKey
Key = bytes | PublicKey

KEY_FIELD = "owner.jwt.key"
SECRET_FILE_FIELD = "owner.jwt.secret_file"
ALGORITHMS_FIELD = "owner.jwt.algorithms"
ENV_PREFIX = "env:"

_RSA_ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"})
# RFC 7518 §3.4: each ES algorithm is bound to one curve.
_CURVE_ALGORITHMS = {
    "secp256r1": "ES256",
    "secp384r1": "ES384",
    "secp521r1": "ES512",
    "secp256k1": "ES256K",
}
# RFC 7518 §3.2: an HMAC key at least as long as the hash output.
_HMAC_MIN_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}
_RSA_MIN_BITS = 2048  # RFC 7518 §3.3
# RFC 7518 §6: members that only a private (or symmetric) JWK has.
_PRIVATE_JWK_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})


@dataclass(frozen=True, slots=True)
class VerificationKey:
    """A key and the configured algorithms it may verify (never empty)."""

    key: Key = field(repr=False)  # an HMAC secret must not show in a log or traceback
    algorithms: tuple[str, ...]


Refresh = Callable[[], Awaitable[None]]
# Told how each fetch of a fetched key set ended (True: a new key set): the metrics.
FetchObserver = Callable[[bool], None]


def unobserved(fetched: bool) -> None:
    """The `FetchObserver` that does nothing."""
    del fetched


class KeySource(Protocol):
    """Where a verifier finds the key for a token's `kid`."""

    def select(self, kid: object) -> VerificationKey | None:
        """The key for `kid` (None: the token names no key of this source)."""
        ...

    def refresh_for(self, kid: object) -> Refresh | None:
        """For a `kid` that `select` found no key for: a wait for the keys to be fetched again
        (it raises `IdentityUnavailable` when they cannot be), or None when the keys held are
        current and the kid is simply unknown."""
        ...

    async def start(self, observe: FetchObserver = unobserved) -> None:
        """Once, in the event loop, before the first request; `observe` hears of each fetch."""
        ...

    async def close(self) -> None: ...

    def not_ready(self) -> str | None:
        """Why no token can be verified yet (for /readyz); None once it can."""
        ...


@dataclass(frozen=True, slots=True)
class KeyRing:
    """Keys by `kid`, and the key for a token that names none (or for a single PEM/secret key).
    Read once at start-up: a `KeySource` that is never refreshed."""

    by_kid: Mapping[str, VerificationKey]
    default: VerificationKey | None

    def select(self, kid: object) -> VerificationKey | None:
        if not self.by_kid or kid is None:
            return self.default
        return self.by_kid.get(kid) if isinstance(kid, str) else None

    def refresh_for(self, kid: object) -> Refresh | None:
        del kid
        return None

    async def start(self, observe: FetchObserver = unobserved) -> None:
        del observe  # read once, never fetched

    async def close(self) -> None:
        return None

    def not_ready(self) -> str | None:
        return None

    @property
    def size(self) -> int:
        return len(self.by_kid) or int(self.default is not None)


def load_keys(
    source: str, algorithms: Sequence[str], environ: Mapping[str, str], secret: str | None = None
) -> KeyRing:
    """The key ring for `owner.jwt.key`, or for the HMAC `secret` read from
    `owner.jwt.secret_file`; raises `ConfigError` naming the field."""
    if not algorithms:
        raise ConfigError(f"{ALGORITHMS_FIELD}: at least one algorithm is required")
    if secret is not None:
        return KeyRing({}, _shared_secret(secret, algorithms, SECRET_FILE_FIELD))
    if source.startswith(ENV_PREFIX):
        return KeyRing({}, _secret(source.removeprefix(ENV_PREFIX), algorithms, environ))
    hmac = sorted(set(algorithms) & set(c.JWT_HMAC_ALGORITHMS))
    if hmac:
        raise ConfigError(
            f"{ALGORITHMS_FIELD}: {', '.join(hmac)} needs a shared secret ({KEY_FIELD}: env:NAME),"
            " never a public key file"
        )
    data = _read(Path(source))
    if data.lstrip().startswith(b"{"):
        return parse_jwks(data, algorithms, KEY_FIELD)
    key = _pem(data)
    unfit = sorted(set(algorithms) - fitting_algorithms(key))
    if unfit:
        raise ConfigError(f"{ALGORITHMS_FIELD}: {', '.join(unfit)} does not fit the {_kind(key)}")
    return KeyRing({}, _bound(key, algorithms, KEY_FIELD))


def fitting_algorithms(key: Key) -> frozenset[str]:
    """The algorithms this type of key verifies (RFC 7518 §3, RFC 8037 §3.1)."""
    if isinstance(key, bytes):
        return frozenset(c.JWT_HMAC_ALGORITHMS)
    if isinstance(key, RSAPublicKey):
        return _RSA_ALGORITHMS
    if isinstance(key, EllipticCurvePublicKey):
        algorithm = _CURVE_ALGORITHMS.get(key.curve.name)
        return frozenset({algorithm} if algorithm else ())
    return frozenset({"EdDSA"})


def _secret(name: str, algorithms: Sequence[str], environ: Mapping[str, str]) -> VerificationKey:
    _check_hmac_only(algorithms, "env:NAME")
    value = environ.get(name)
    if not value:
        raise ConfigError(f"{KEY_FIELD}: environment variable {name} is not set or empty")
    return _bound(value.encode("utf-8"), algorithms, KEY_FIELD)


def _shared_secret(value: str, algorithms: Sequence[str], where: str) -> VerificationKey:
    _check_hmac_only(algorithms, where)
    return _bound(value.encode("utf-8"), algorithms, where)


def _check_hmac_only(algorithms: Sequence[str], given_as: str) -> None:
    other = sorted(set(algorithms) - set(c.JWT_HMAC_ALGORITHMS))
    if other:
        raise ConfigError(
            f"{ALGORITHMS_FIELD}: a shared secret ({given_as}) verifies HS256/HS384/HS512 only,"
            f" not {', '.join(other)}"
        )


def _bound(key: Key, algorithms: Iterable[str], where: str) -> VerificationKey:
    """Bind `key` to the algorithms of `algorithms` it fits, after checking its strength."""
    usable = tuple(a for a in algorithms if a in fitting_algorithms(key))
    if isinstance(key, bytes):
        _check_secret(key, where)
        need = max(_HMAC_MIN_BYTES[a] for a in usable)
        if len(key) < need:
            raise ConfigError(
                f"{where}: the shared secret is {len(key)} bytes; {', '.join(usable)} needs at"
                f" least {need} (RFC 7518 §3.2)"
            )
    elif isinstance(key, RSAPublicKey) and key.key_size < _RSA_MIN_BITS:
        raise ConfigError(f"{where}: the RSA key has {key.key_size} bits; at least 2048 needed")
    return VerificationKey(key, usable)


def _check_secret(secret: bytes, where: str) -> None:
    try:
        HMACAlgorithm(HMACAlgorithm.SHA256).prepare_key(secret)
    except jwt.InvalidKeyError as exc:
        # PyJWT refuses a PEM, SSH or DER key as an HMAC secret: every token would fail.
        raise ConfigError(
            f"{where}: the shared secret looks like a public key, not a secret"
        ) from exc


def _read(path: Path) -> bytes:
    # The value is not echoed: a secret put here by mistake must not land in a log.
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{KEY_FIELD}: cannot read the key file ({exc.strerror}); give a PEM or JWKS file"
            " path, or env:NAME for a shared secret"
        ) from exc


def _pem(data: bytes) -> PublicKey:
    if b"PRIVATE KEY" in data:
        raise ConfigError(f"{KEY_FIELD}: the file holds a private key; give the public key")
    try:
        key: object = load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        try:
            key = x509.load_pem_x509_certificate(data).public_key()
        except ValueError as exc:
            raise ConfigError(
                f"{KEY_FIELD}: not a PEM public key, PEM certificate or JWKS file"
            ) from exc
    return _public(key, KEY_FIELD)


def _public(key: object, where: str) -> PublicKey:
    if not isinstance(
        key, RSAPublicKey | EllipticCurvePublicKey | Ed25519PublicKey | Ed448PublicKey
    ):
        raise ConfigError(f"{where}: unsupported key type (RSA, EC or Ed25519/Ed448 only)")
    if isinstance(key, EllipticCurvePublicKey) and key.curve.name not in _CURVE_ALGORITHMS:
        raise ConfigError(f"{where}: unsupported EC curve {key.curve.name}")
    return key


def _kind(key: Key) -> str:
    if isinstance(key, RSAPublicKey):
        return "RSA public key"
    if isinstance(key, EllipticCurvePublicKey):
        return f"EC public key on {key.curve.name}"
    return "EdDSA public key"


def parse_jwks(data: bytes, algorithms: Sequence[str], where: str) -> KeyRing:
    """The key ring of a JWKS document (RFC 7517 §5): from the file of `owner.jwt.key`, or as
    an identity provider served it; `ConfigError` naming `where` when it is unusable."""
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"{where}: the JWKS is not valid JSON") from exc
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f'{where}: a JWKS needs a non-empty "keys" list')
    usable = [
        bound
        for index, entry in enumerate(entries)
        if (bound := _jwk(entry, algorithms, f"{where} keys[{index}]")) is not None
    ]
    return _ring(usable, where)


def _jwk(
    entry: Any, algorithms: Sequence[str], where: str
) -> tuple[str | None, VerificationKey] | None:
    """One JWKS entry bound to its algorithms; None for an encryption key or one that no
    configured algorithm fits (a JWKS may hold keys for other services)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: not a JSON object")
    if entry.get("kty") == "oct" or _PRIVATE_JWK_MEMBERS & entry.keys():
        raise ConfigError(
            f"{where}: a private or symmetric key; a JWKS holds public keys (a shared"
            " secret goes in env:NAME)"
        )
    kid = entry.get("kid")
    if kid is not None and not isinstance(kid, str):
        raise ConfigError(f"{where}: kid must be a string")
    if entry.get("use", "sig") != "sig":
        return None
    try:
        key = _public(jwt.PyJWK(entry).key, where)
    except jwt.PyJWTError as exc:
        raise ConfigError(f"{where}: not a valid public JWK") from exc
    # RFC 7517 §4.4: a key that names its algorithm is used with that one only.
    named = entry.get("alg")
    usable = [a for a in algorithms if a in fitting_algorithms(key) and named in (None, a)]
    return (kid, _bound(key, usable, where)) if usable else None


def _ring(usable: list[tuple[str | None, VerificationKey]], where: str) -> KeyRing:
    if not usable:
        raise ConfigError(f"{where}: no signing key in the JWKS fits {ALGORITHMS_FIELD}")
    by_kid: dict[str, VerificationKey] = {}
    for kid, key in usable:
        if kid is None and len(usable) > 1:
            raise ConfigError(f"{where}: every key needs a kid when the JWKS holds several")
        if kid is not None and by_kid.setdefault(kid, key) is not key:
            raise ConfigError(f"{where}: kid {kid!r} appears twice in the JWKS")
    return KeyRing(by_kid, usable[0][1] if len(usable) == 1 else None)
