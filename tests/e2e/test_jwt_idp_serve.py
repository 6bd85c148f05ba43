"""`idemproxy serve` with owner JWT keys from an identity provider (SPEC §5), as a real process
in front of a real backend and a real HTTPS identity provider (tests/support/idp.py).

The provider is down when the proxy starts: one warning line, the proxy serves, /readyz says
`identity-unavailable` and tokens are answered 503 until a retry loads the keys; then tokens
verify and /readyz is ready.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from tests.support.idp import IdentityProvider
from tests.support.jwtkit import AUDIENCE, bearer, claims, rsa_key, token
from tests.support.proxychecks import KEY

if TYPE_CHECKING:
    from .conftest import Backend, StartProxy

pytestmark = pytest.mark.slow


async def _ready(session: aiohttp.ClientSession, admin: str) -> tuple[int, str]:
    async with session.get(f"{admin}/readyz") as response:
        return response.status, (await response.json())["status"]


async def test_a_provider_down_at_start_is_a_warning_then_not_ready_until_it_answers(
    tmp_path: Path, start_proxy: StartProxy, backend: Backend
) -> None:
    idp = IdentityProvider(tmp_path)
    idp.publish((rsa_key(0), "k1"))
    await idp.start()
    await idp.stop()  # its address is known; nothing listens there yet
    env = {
        "IDEMPROXY_OWNER__STRATEGY": "jwt",
        "IDEMPROXY_OWNER__JWT__JWKS_URI": idp.jwks_uri,
        "IDEMPROXY_OWNER__JWT__ALGORITHMS": "RS256",
        "IDEMPROXY_OWNER__JWT__AUDIENCE": AUDIENCE,
        "IDEMPROXY_OWNER__JWT__IDP__MIN_REFRESH_INTERVAL": "500ms",
        "IDEMPROXY_OWNER__JWT__IDP__TIMEOUT": "2s",
        "IDEMPROXY_OWNER__JWT__IDP__TLS__CA_FILE": str(idp.ca_file),
    }
    store = f"sqlite:///{tmp_path}/idemproxy.db"
    proxy = await start_proxy("--upstream", backend.url, "--store", store, env=env)
    headers = {KEY: "k", **bearer(token(claims("alice"), rsa_key(0), "RS256", kid="k1"))}
    try:
        async with aiohttp.ClientSession() as session:
            assert await _ready(session, proxy.admin_url) == (503, "identity-unavailable")
            async with session.post(f"{proxy.url}/pay", json={}, headers=headers) as refused:
                assert refused.status == 503
                assert refused.headers["Idempotency-Error"] == "identity-unavailable"
            # The first of them: retries that fail too are a line each.
            warning = next(line for line in proxy.stderr().splitlines() if "owner.jwt" in line)
            assert f"no keys yet from {idp.jwks_uri}: " in warning, proxy.describe()
            assert "Cannot connect" in warning, warning  # the cause, on the same line
            assert "Traceback" not in proxy.stderr()
            await idp.start()
            loop = asyncio.get_running_loop()
            until = loop.time() + 10
            while (await _ready(session, proxy.admin_url))[0] != 200:
                assert loop.time() < until, proxy.describe()
                await asyncio.sleep(0.1)
            async with session.post(f"{proxy.url}/pay", json={}, headers=headers) as answered:
                assert answered.status == 201, await answered.text()
        assert backend.ledger.count() == 1
        assert "key(s) loaded from" in proxy.stderr()
    finally:
        await idp.stop()
