"""The digest of a request as it goes upstream (SPEC §3.6: a request sent again under the key
its upstream honours goes out byte for byte as the first did)."""

from __future__ import annotations

import hashlib


def sent_digest(method: str, target: str, body_sha256: bytes) -> str:
    """SPEC §3.6: what goes upstream of a request, as its backend would compare it: method,
    target byte for byte (SPEC §10) and body bytes (their SHA-256). Hashed apart from the
    fingerprint, which canonicalises JSON and may leave members out (SPEC §6)."""
    digest = hashlib.sha256()
    for part in (method.encode(), target.encode("utf-8", "surrogateescape"), body_sha256):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()
