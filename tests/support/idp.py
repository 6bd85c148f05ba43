"""A real identity provider for the JWT owner tests: HTTPS on loopback with certificates made by
`trustme`, an OpenID Connect discovery document and a JWKS, counting the fetches of each."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import trustme
from aiohttp import web

from tests.support.jwtkit import PrivateKey, public_jwk

DISCOVERY = "/realms/test/.well-known/openid-configuration"
JWKS = "/realms/test/protocol/openid-connect/certs"


class IdentityProvider:
    """`publish` sets the key set served; `delay` holds each JWKS answer that long; `status`
    answers the JWKS with that status instead; `issuer_named` is the discovery document's
    `issuer` (by default the right one); `cache_control` is sent with the JWKS. With
    `client_certificates`, every client must present a certificate issued by `client_ca`
    (mTLS); `client_cert_file` and `client_key_file` hold one."""

    def __init__(self, folder: Path, *, client_certificates: bool = False) -> None:
        self.client_certificates = client_certificates
        self.client_ca = trustme.CA()
        client = self.client_ca.issue_cert("proxy.test")
        self.client_cert_file = folder / "idp-client.pem"
        self.client_cert_file.write_bytes(client.cert_chain_pems[0].bytes())
        self.client_key_file = folder / "idp-client.key"
        self.client_key_file.write_bytes(client.private_key_pem.bytes())
        self.ca = trustme.CA()
        self.ca_file = folder / "idp-ca.pem"
        self.ca_file.write_bytes(self.ca.cert_pem.bytes())
        self.other_ca_file = folder / "other-ca.pem"
        self.other_ca_file.write_bytes(trustme.CA().cert_pem.bytes())
        self.jwks: list[dict[str, Any]] = []
        self.jwks_fetches = 0
        self.discovery_fetches = 0
        self.pending = 0  # JWKS answers being held (delay)
        self.delay = 0.0
        self.status = 200
        self.cache_control: str | None = None
        self.issuer_named: str | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._port = 0

    @property
    def issuer(self) -> str:
        return f"{self.url}/realms/test"

    @property
    def jwks_uri(self) -> str:
        return f"{self.url}{JWKS}"

    def publish(self, *keys: tuple[PrivateKey, str]) -> None:
        self.jwks = [public_jwk(private, kid, alg="RS256", use="sig") for private, kid in keys]

    async def _discovery(self, request: web.Request) -> web.Response:
        del request
        self.discovery_fetches += 1
        issuer = self.issuer if self.issuer_named is None else self.issuer_named
        return web.json_response({"issuer": issuer, "jwks_uri": self.jwks_uri})

    async def _keys(self, request: web.Request) -> web.Response:
        del request
        self.jwks_fetches += 1
        if self.delay:
            self.pending += 1
            try:
                await asyncio.sleep(self.delay)
            finally:
                self.pending -= 1
        if self.status != 200:
            return web.Response(status=self.status)
        headers = {} if self.cache_control is None else {"Cache-Control": self.cache_control}
        return web.json_response({"keys": self.jwks}, headers=headers)

    def _context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("127.0.0.1").configure_cert(context)
        if self.client_certificates:
            context.verify_mode = ssl.CERT_REQUIRED
            self.client_ca.configure_trust(context)
        return context

    async def start(self) -> None:
        """Listens (again, on the same port after `stop`)."""
        app = web.Application()
        app.router.add_get(DISCOVERY, self._discovery)
        app.router.add_get(JWKS, self._keys)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port, ssl_context=self._context())
        await site.start()
        self._port = self._runner.addresses[0][1]
        self.url = f"https://127.0.0.1:{self._port}"

    async def stop(self) -> None:
        """Down: connections are refused."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> IdentityProvider:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()
