"""Key rings for the tests of encryption at rest (SPEC §11): fixed keys with ids."""

from __future__ import annotations

import base64

from idemproxy.store.seal.codec import ResponseCodec
from idemproxy.store.seal.keyring import parse_key_ring


def key_entry(key_id: str, fill: int) -> str:
    """`id:base64` of a 32-byte key of `fill` bytes (distinct fills, distinct keys)."""
    return f"{key_id}:{base64.b64encode(bytes([fill]) * 32).decode()}"


OLD = key_entry("k1", 1)
NEW = key_entry("k2", 2)
OTHER = key_entry("k9", 9)


def codec(*entries: str, require_sealed: bool = False) -> ResponseCodec:
    """A codec whose ring lists `entries`, the first the primary."""
    return ResponseCodec(parse_key_ring(",".join(entries)), require_sealed=require_sealed)
