"""The key ring of encryption at rest (SPEC §11): AES-256 keys, each with an id. Pure.

`encryption.keys` is a list of `id:base64` entries (32 bytes each, standard or URL-safe base64)
separated by commas or line breaks. The first is the primary: new responses are sealed with it;
every other one only opens responses sealed before. So a key is rotated without downtime:
added at the end everywhere, then moved to the front, then the old rows resealed, then retired
(docs/operations.md, Encryption keys).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from idemproxy.errors import ConfigError

KEY_BYTES = 32  # AES-256
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,32}")
_SETTING = "encryption.keys"


@dataclass(frozen=True, slots=True)
class KeyRing:
    """`primary` seals; every key in `ciphers` opens."""

    primary: str
    ciphers: dict[str, AESGCM]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self.ciphers)


def parse_key_ring(text: str) -> KeyRing:
    """The ring `text` lists; `ConfigError` naming the entry at fault, never its key bytes."""
    entries = [entry.strip() for entry in re.split(r"[,\n]", text) if entry.strip()]
    if not entries:
        raise ConfigError(f"{_SETTING}: no key given")
    ciphers: dict[str, AESGCM] = {}
    for number, entry in enumerate(entries, start=1):
        key_id, key = _entry(entry, number)
        if key_id in ciphers:
            raise ConfigError(f"{_SETTING}: key id {key_id!r} is given twice")
        ciphers[key_id] = AESGCM(key)
    return KeyRing(next(iter(ciphers)), ciphers)


def _entry(entry: str, number: int) -> tuple[str, bytes]:
    key_id, sep, encoded = entry.partition(":")
    key_id = key_id.strip()
    if not sep or _KEY_ID.fullmatch(key_id) is None:
        raise ConfigError(
            f"{_SETTING}: entry {number} is not id:base64 (an id of 1-32 letters, digits, '.', '_'"
            " or '-', then the key)"
        )
    try:
        key = base64.b64decode(_standard(encoded.strip()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigError(f"{_SETTING}: key {key_id!r} is not base64") from exc
    if len(key) != KEY_BYTES:
        raise ConfigError(
            f"{_SETTING}: key {key_id!r} has {len(key)} bytes; AES-256 needs {KEY_BYTES}"
        )
    return key_id, key


def _standard(encoded: str) -> str:
    padded = encoded + "=" * (-len(encoded) % 4)
    return padded.replace("-", "+").replace("_", "/")
