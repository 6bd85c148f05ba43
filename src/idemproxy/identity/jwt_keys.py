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
import logging
from collections import Counter
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

log = logging.getLogger("idemproxy.owner")

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
# RFC 7518 §6.2.1.1: a JWK's crv for each curve of `_CURVE_ALGORITHMS`.
_JWK_CURVE_ALGORITHMS = {
    "P-256": "ES256",
    "P-384": "ES384",
    "P-521": "ES512",
    "secp256k1": "ES256K",
}
_SHOWN_KID = 64  # characters of a kid shown in a log line
_SHOWN_SKIPPED = 5  # entries left out shown one by one, in a log or an error
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

    def refresh_for(self, kid: object, signed_by: float | None = None) -> Refresh | None:
        """For a `kid` that `select` found no key for: a wait for the keys to be fetched again
        (it raises `IdentityUnavailable` when they cannot be), or None when keys fetched after
        the token was signed (`signed_by`: its iat plus the leeway, wall clock; None when it
        names no iat) are held and the kid is simply unknown."""
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
    # The JWKS entries left out, each as `keys[n] (kid '…'): why` (RFC 7517 §5).
    skipped: tuple[str, ...] = ()

    def select(self, kid: object) -> VerificationKey | None:
        if not self.by_kid or kid is None:
            return self.default
        return self.by_kid.get(kid) if isinstance(kid, str) else None

    def refresh_for(self, kid: object, signed_by: float | None = None) -> Refresh | None:
        del kid, signed_by
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
        ring = parse_jwks(data, algorithms, KEY_FIELD)
        log_skipped(ring, f"the JWKS file of {KEY_FIELD}")
        return ring
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
    an identity provider served it; `ConfigError` naming `where` when it is unusable.

    RFC 7517 §5: an entry that is no signing key for a configured algorithm (an encryption key,
    another key type or curve, a weak RSA key, one holding private members, a malformed one) is
    left out and named in `KeyRing.skipped`; the rest load. A document with no usable key at
    all is an error. Key type, curve and `alg` are checked before any key is built, so that a
    large set of keys for other algorithms costs almost nothing.
    """
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"{where}: the JWKS is not valid JSON") from exc
    except RecursionError as exc:  # valid, but no JWKS nests a thousand levels deep
        raise ConfigError(f"{where}: the JWKS is nested too deeply") from exc
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f'{where}: a JWKS needs a non-empty "keys" list')
    usable: list[tuple[int, str | None, VerificationKey]] = []
    skipped: list[str] = []
    for index, entry in enumerate(entries):
        found = _jwk(entry, algorithms, where)
        if isinstance(found, str):
            skipped.append(f"keys[{index}]{_kid_shown(entry)}: {found}")
        else:
            usable.append((index, *found))
    kept = _unambiguous(usable, skipped)
    # A token without a kid is verified with the only usable key, never with one left over.
    default = kept[0][1] if len(usable) == 1 else None
    return _ring(kept, default, tuple(skipped), where)


def _unambiguous(
    usable: list[tuple[int, str | None, VerificationKey]], skipped: list[str]
) -> list[tuple[str | None, VerificationKey]]:
    """The usable keys a token's kid selects one way only: among several, a key without a kid
    and keys sharing a kid are left out too (added to `skipped`); a kid the provider names
    twice is no key of its own."""
    counts = Counter(kid for _, kid, _ in usable)
    kept: list[tuple[str | None, VerificationKey]] = []
    for index, kid, key in usable:
        if kid is None and len(usable) > 1:
            skipped.append(f"keys[{index}]: no kid, and the JWKS holds several keys")
        elif kid is not None and counts[kid] > 1:
            skipped.append(f"keys[{index}] (kid {kid[:_SHOWN_KID]!a}): the kid appears twice")
        else:
            kept.append((kid, key))
    return kept


def _kid_shown(entry: Any) -> str:
    kid = entry.get("kid") if isinstance(entry, dict) else None
    # !a: a kid is the provider's text, shown with no control or non-ASCII character.
    return "" if kid is None else f" (kid {str(kid)[:_SHOWN_KID]!a})"


def _jwk(
    entry: Any, algorithms: Sequence[str], where: str
) -> tuple[str | None, VerificationKey] | str:
    """One JWKS entry bound to its algorithms, or why it is left out (a JWKS may hold keys for
    other services and other purposes)."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    kid = entry.get("kid")
    if kid is not None and not isinstance(kid, str):
        return "kid is not a string (RFC 7517 §4.5)"
    if entry.get("kty") == "oct" or _PRIVATE_JWK_MEMBERS & entry.keys():
        return "a private or symmetric key: never used (a shared secret goes in env:NAME)"
    if entry.get("use", "sig") != "sig":
        return "not a signing key (use)"
    candidates = _candidate_algorithms(entry, algorithms)
    if isinstance(candidates, str):
        return candidates
    try:
        key = _public(jwt.PyJWK(entry, candidates[0]).key, where)
    except (jwt.PyJWTError, ConfigError, ValueError, TypeError, KeyError, NotImplementedError):
        return "not a valid public JWK"
    if isinstance(key, RSAPublicKey) and key.key_size < _RSA_MIN_BITS:
        return f"an RSA key of {key.key_size} bits; at least {_RSA_MIN_BITS} needed"
    usable = [a for a in candidates if a in fitting_algorithms(key)]
    if not usable:
        return f"fits none of {ALGORITHMS_FIELD}"
    return (kid, _bound(key, usable, where))


def _candidate_algorithms(entry: dict[str, Any], algorithms: Sequence[str]) -> list[str] | str:
    """The configured algorithms this entry's kty, crv and alg allow, without building it."""
    kty = entry.get("kty")
    if kty == "RSA":
        fitting: frozenset[str] = _RSA_ALGORITHMS
    elif kty == "EC":
        algorithm = _JWK_CURVE_ALGORITHMS.get(entry.get("crv"))  # type: ignore[arg-type]
        if algorithm is None:
            return "an EC curve no algorithm verifies with"
        fitting = frozenset({algorithm})
    elif kty == "OKP":
        if entry.get("crv") not in ("Ed25519", "Ed448"):
            return "an OKP curve that does not sign (RFC 8037 §3.1)"
        fitting = frozenset({"EdDSA"})
    else:
        return "a key type no configured algorithm uses"
    # RFC 7517 §4.4: a key that names its algorithm is used with that one only.
    named = entry.get("alg")
    usable = [a for a in algorithms if a in fitting and named in (None, a)]
    if not usable:
        return f"fits none of {ALGORITHMS_FIELD}"
    return usable


def _ring(
    usable: list[tuple[str | None, VerificationKey]],
    default: VerificationKey | None,
    skipped: tuple[str, ...],
    where: str,
) -> KeyRing:
    if not usable:
        shown = "; ".join(skipped[:_SHOWN_SKIPPED])
        more = (
            f"; and {len(skipped) - _SHOWN_SKIPPED} more" if len(skipped) > _SHOWN_SKIPPED else ""
        )
        raise ConfigError(
            f"{where}: no signing key in the JWKS fits {ALGORITHMS_FIELD} ({shown}{more})"
        )
    by_kid = {kid: key for kid, key in usable if kid is not None}
    return KeyRing(by_kid, default, skipped)


def log_skipped(ring: KeyRing, source: str, logged: set[str] | None = None) -> None:
    """One warning per JWKS entry left out (and not in `logged`, which it is added to), at most
    `_SHOWN_SKIPPED` lines and then a count, so that a large key set cannot flood the log."""
    new = [entry for entry in ring.skipped if logged is None or entry not in logged]
    for entry in new[:_SHOWN_SKIPPED]:
        log.warning("owner.jwt: %s, %s: left out", source, entry)
    if len(new) > _SHOWN_SKIPPED:
        log.warning("owner.jwt: %s: %d more keys left out", source, len(new) - _SHOWN_SKIPPED)
    if logged is not None:
        logged.update(new)
