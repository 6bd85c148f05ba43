"""Which routes declare that their upstream honours the key, and for how long (SPEC §3.6), and
the digest of a request as it goes upstream."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from idemproxy.config.settings import Settings
from idemproxy.core.types import Job


@dataclass(frozen=True, slots=True)
class Declared:
    """A route (`prefix`) whose `upstreams` deduplicate on the key for `window` seconds."""

    prefix: str
    upstreams: frozenset[str]
    window: float

    def covers(self, path: str) -> bool:
        decoded = unquote(path.partition("?")[0])
        return self.prefix in ("/", decoded) or decoded.startswith(self.prefix.rstrip("/") + "/")


class Resender:
    """The routes that declared `resolve.upstream_honours_key`, longest prefix first."""

    def __init__(self, declared: Sequence[Declared]) -> None:
        self._declared = sorted(declared, key=lambda d: len(d.prefix), reverse=True)

    @classmethod
    def from_settings(cls, settings: Settings) -> Resender | None:
        declared = [
            Declared(
                route.prefix,
                frozenset((route.upstream, *route.fallbacks)),
                route.resolve.upstream_honours_key.window,
            )
            for route in settings.all_routes
            if route.resolve.upstream_honours_key is not None
        ]
        return cls(declared) if declared else None

    def route_of(self, path: str) -> Declared | None:
        return next((d for d in self._declared if d.covers(path)), None)

    def covers(self, job: Job) -> bool:
        return self.route_of(job.path) is not None


def sent_digest(method: str, target: str, body_sha256: bytes) -> str:
    """SPEC §3.6: what goes upstream of a request, as its backend would compare it: method,
    target byte for byte (SPEC §10) and body bytes (their SHA-256). Hashed apart from the
    fingerprint, which canonicalises JSON and may leave members out (SPEC §6)."""
    digest = hashlib.sha256()
    for part in (method.encode(), target.encode("utf-8", "surrogateescape"), body_sha256):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()
