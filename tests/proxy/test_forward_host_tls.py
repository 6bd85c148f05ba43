"""SPEC §10 `forward_host: auto` with an https:// upstream: the upstream's own name as Host.

TLS to a named host: SNI and the certificate name the upstream, and a CDN in front of it answers
421 or 403 to a Host naming something else, so an external API (config/llm-gateway.yaml) keeps
working as documented; `client` there is a choice, and is honoured.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.proxychecks import KEY

from .conftest import ProxyFactory
from .upstream_leg import Certificates, Upstream


@pytest.fixture
def certs(tmp_path: Path) -> Certificates:
    return Certificates(tmp_path)


@pytest.mark.parametrize(
    ("forward_host", "expected"),
    [("auto", None), ("upstream", None), ("client", "api.example.com"), ("fixed.test", None)],
)
async def test_an_https_upstream_receives_the_host_its_setting_names(
    proxy: ProxyFactory, certs: Certificates, forward_host: str, expected: str | None
) -> None:
    async with Upstream(certs.server_context()) as upstream:
        client = await proxy(
            upstream=upstream.url,
            upstreams={upstream.url: {"tls": {"ca_file": str(certs.ca_file)}}},
            forward_host=forward_host,
        )
        for extra in ({}, {KEY: "k-tls"}):
            headers = {"Host": "api.example.com", **extra}
            async with client.post("/pay", json={}, headers=headers) as response:
                assert response.status == 201, await response.text()
        authority = upstream.url.removeprefix("https://")
        wanted = expected or (forward_host if forward_host == "fixed.test" else authority)
        assert [seen["Host"] for seen in upstream.headers] == [wanted, wanted]
        assert {seen["X-Forwarded-Host"] for seen in upstream.headers} == {"api.example.com"}
