"""One fetch of an identity provider's keys over HTTPS (SPEC §5): the JWKS at `jwks_uri`, or
the one the issuer's OpenID Connect discovery document names (OIDC Discovery 1.0 §4).

Redirects are not followed (a JWKS URL that moves is a setting to change, and following one
could leave HTTPS); a document must be a 200 answer of at most `MAX_JWKS_BYTES`.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp

from idemproxy import constants as c
from idemproxy.config.settings import JwtSettings, check_https_url
from idemproxy.errors import ConfigError
from idemproxy.identity.jwt_keys import KeyRing, parse_jwks
from idemproxy.redact import escaped, redact_url

DISCOVERY_PATH = "/.well-known/openid-configuration"
# RFC 9111 §5.2.2.1; no-store and no-cache (§5.2.2.4, §5.2.2.5) read as max-age=0.
_MAX_AGE = re.compile(r"max-age=\"?(\d+)\"?", re.IGNORECASE)
_SHOWN_ISSUER = 200  # characters of a wrong `issuer` shown in the error


class FetchFailed(Exception):
    """Why the keys could not be fetched, as one line for the log."""


@dataclass(frozen=True, slots=True)
class Fetched:
    keys: KeyRing
    # Seconds the provider says the key set stays fresh (Cache-Control), None when it says not.
    max_age: float | None


class JwksClient:
    """Fetches the key set for `settings` (owner.jwt) over its own connection pool."""

    def __init__(self, settings: JwtSettings, tls: ssl.SSLContext) -> None:
        self._settings = settings
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None

    @property
    def source(self) -> str:
        """Where the keys come from, for a log line (never a credential)."""
        if self._settings.jwks_uri is not None:
            return redact_url(self._settings.jwks_uri)
        return f"the discovery document of {redact_url(self._settings.issuer or '')}"

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._tls, limit=2),
            # The caller bounds the whole fetch (owner.jwt.idp.timeout).
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self) -> Fetched:
        """The key set now; `FetchFailed` (or `ConfigError` for an unusable JWKS)."""
        uri = self._settings.jwks_uri or await self._discover()
        body, max_age = await self._get(uri)
        # In a thread: building a few thousand keys (a 1 MiB JWKS) takes long enough to stall
        # every request the event loop serves meanwhile.
        keys = await asyncio.to_thread(
            parse_jwks, body, self._settings.algorithms, f"the JWKS at {redact_url(uri)}"
        )
        return Fetched(keys, max_age)

    async def _discover(self) -> str:
        issuer = self._settings.issuer or ""
        url = issuer.rstrip("/") + DISCOVERY_PATH
        body, _ = await self._get(url)
        try:
            document = json.loads(body)
        except ValueError as exc:
            raise FetchFailed(f"{redact_url(url)}: not JSON") from exc
        if not isinstance(document, dict):
            raise FetchFailed(f"{redact_url(url)}: not a JSON object")
        named = document.get("issuer")
        # OIDC Discovery 1.0 §4.3: the issuer must be identical to the URL it was found under,
        # or another tenant's document (and keys) could stand in for this one's.
        if named != issuer:
            shown = escaped(str(named)[:_SHOWN_ISSUER])
            raise FetchFailed(f"{redact_url(url)} names issuer {shown!r}, not owner.jwt.issuer")
        jwks_uri = document.get("jwks_uri")
        if not isinstance(jwks_uri, str):
            raise FetchFailed(f"{redact_url(url)} names no jwks_uri")
        try:
            return check_https_url(jwks_uri)
        except ValueError as exc:
            raise FetchFailed(f"{redact_url(url)}: its jwks_uri {exc}") from exc

    async def _get(self, url: str) -> tuple[bytes, float | None]:
        if self._session is None:
            raise RuntimeError("JwksClient.open() was not called")
        request = self._session.get(
            url, allow_redirects=False, headers={"Accept": "application/json"}
        )
        async with request as response:
            if response.status != 200:
                raise FetchFailed(f"{redact_url(url)} answered {response.status}")
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > c.MAX_JWKS_BYTES:
                    raise FetchFailed(f"{redact_url(url)}: larger than {c.MAX_JWKS_BYTES} bytes")
            return bytes(body), max_age(response.headers.getall("Cache-Control", ()))


def max_age(fields: Iterable[str]) -> float | None:
    """The freshness lifetime a response's Cache-Control fields give (RFC 9111 §5.2.2)."""
    found: float | None = None
    for directive in (part.strip() for value in fields for part in value.split(",")):
        if directive.lower() in ("no-store", "no-cache"):
            return 0.0
        match = _MAX_AGE.fullmatch(directive)
        if match is not None:
            found = float(match.group(1))
    return found


def describe(error: BaseException) -> str:
    """One printable line for why a fetch failed."""
    if isinstance(error, FetchFailed | ConfigError):
        return escaped(str(error))
    if isinstance(error, TimeoutError):
        return "timed out (owner.jwt.idp.timeout)"
    if isinstance(error, aiohttp.ClientConnectorCertificateError):
        return escaped(f"TLS: {error.certificate_error}")
    text = str(error)
    return escaped(f"{type(error).__name__}: {text}" if text else type(error).__name__)
