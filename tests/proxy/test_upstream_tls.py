"""TLS to upstreams (`upstreams.<url>.tls`, SPEC §10) against a real HTTPS upstream on loopback
with certificates made by `trustme`: verified against the configured CA, mTLS, a server name of
its own; every refused handshake is a connect failure, so the job is released and the upstream
executed nothing (SPEC §3.2)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path
from typing import Any

import pytest
import uvloop
from pydantic import ValidationError
from yarl import URL

from idemproxy.config.settings import load_settings
from idemproxy.config.upstream import UpstreamSettings, UpstreamTlsSettings
from idemproxy.core.machine import Failure
from idemproxy.core.types import JobState
from idemproxy.errors import ConfigError
from idemproxy.proxy.upstream.client import UpstreamClient, UpstreamFailure
from idemproxy.proxy.upstream.dial import Dialing
from idemproxy.store.base import Store
from tests.support.proxychecks import KEY, assert_problem, only_job

from .conftest import ProxyFactory
from .upstream_leg import BlockingTlsUpstream, Certificates, Upstream


@pytest.fixture
def certs(tmp_path: Path) -> Certificates:
    return Certificates(tmp_path)


def tls_settings(url: str, **tls: Any) -> dict[str, Any]:
    return {"upstream": url, "upstreams": {url: {"tls": tls}}}


async def post(client: Any, key: str = "k1") -> Any:
    return await client.post("/pay", json={"amount": 1}, headers={KEY: key})


async def assert_refused(
    response: Any, upstream: Upstream | BlockingTlsUpstream, jobs: Store
) -> None:
    """502, the job released (nothing was sent: another attempt may run it), nothing executed."""
    await assert_problem(response, "upstream-unavailable", 502)
    job = await only_job(jobs)
    assert job.state is JobState.RELEASED, job.attempts[0].error
    assert upstream.executed == 0


async def test_an_upstream_verified_against_its_ca_file(
    proxy: ProxyFactory, certs: Certificates, jobs: Store
) -> None:
    async with Upstream(certs.server_context()) as upstream:
        client = await proxy(**tls_settings(upstream.url, ca_file=str(certs.ca_file)))
        response = await post(client)
        assert response.status == 201, await response.text()
        assert (await response.json()) == {"executed": 1}
        assert (await only_job(jobs)).state is JobState.COMPLETED


async def test_a_certificate_from_another_ca_is_refused(
    proxy: ProxyFactory, certs: Certificates, jobs: Store
) -> None:
    async with Upstream(certs.server_context()) as upstream:
        client = await proxy(**tls_settings(upstream.url, ca_file=str(certs.other_ca_file)))
        await assert_refused(await post(client), upstream, jobs)


async def test_the_system_store_does_not_trust_a_private_ca(
    proxy: ProxyFactory, certs: Certificates, jobs: Store
) -> None:
    async with Upstream(certs.server_context()) as upstream:
        client = await proxy(upstream=upstream.url)
        await assert_refused(await post(client), upstream, jobs)


async def test_the_client_certificate_an_upstream_requires_is_presented(
    proxy: ProxyFactory, certs: Certificates, jobs: Store
) -> None:
    async with Upstream(certs.server_context(client_certificates=True)) as upstream:
        client = await proxy(
            **tls_settings(
                upstream.url,
                ca_file=str(certs.ca_file),
                cert_file=str(certs.client_cert_file),
                key_file=str(certs.client_key_file),
            )
        )
        response = await post(client)
        assert response.status == 201, await response.text()
        assert upstream.executed == 1


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2])
async def test_no_client_certificate_where_one_is_required_is_refused(
    proxy: ProxyFactory, certs: Certificates, jobs: Store, version: ssl.TLSVersion
) -> None:
    """With TLS 1.2 the handshake fails; with TLS 1.3 the upstream refuses the missing
    certificate after the proxy's handshake ended, with an alert in answer to the request's
    first bytes, which it never decrypted: either way nothing was executed."""
    context = certs.server_context(client_certificates=True)
    context.maximum_version = version
    with BlockingTlsUpstream(context) as upstream:
        client = await proxy(**tls_settings(upstream.url, ca_file=str(certs.ca_file)))
        await assert_refused(await post(client), upstream, jobs)
        assert upstream.refusals == ["PEER_DID_NOT_RETURN_A_CERTIFICATE"]


@pytest.mark.parametrize("server_name", [None, "upstream.test"], ids=["url-host", "server-name"])
async def test_the_server_name_is_sent_and_verified(
    proxy: ProxyFactory, certs: Certificates, jobs: Store, server_name: str | None
) -> None:
    """A certificate for `upstream.test` only, on an upstream reached by its address."""
    async with Upstream(certs.server_context("upstream.test")) as upstream:
        tls: dict[str, Any] = {"ca_file": str(certs.ca_file)}
        if server_name is not None:
            tls["server_name"] = server_name
        client = await proxy(**tls_settings(upstream.url, **tls))
        response = await post(client)
        if server_name is None:
            await assert_refused(response, upstream, jobs)
        else:
            assert response.status == 201, await response.text()
            assert upstream.executed == 1


async def test_verify_false_trusts_any_certificate_and_says_so(
    proxy: ProxyFactory, certs: Certificates, caplog: pytest.LogCaptureFixture
) -> None:
    async with Upstream(certs.server_context("elsewhere.test")) as upstream:
        with caplog.at_level(logging.WARNING, logger="idemproxy.proxy.upstream.dial"):
            client = await proxy(**tls_settings(upstream.url, verify=False))
        assert any("not verified" in r.getMessage() for r in caplog.records), caplog.text
        response = await post(client)
        assert response.status == 201, await response.text()


def test_upstreams_with_the_same_settings_share_one_context(certs: Certificates) -> None:
    a, b = "https://a.test", "https://b.test:8443"
    tls = {"tls": {"ca_file": str(certs.ca_file)}}
    settings = load_settings(
        routes=[{"prefix": "/", "upstream": a, "fallbacks": [b]}],
        upstreams={a: tls, b: tls},
    )
    dialing = Dialing.from_settings(settings)
    first, second = dialing.dialer(("a.test", 443, True)), dialing.dialer(("b.test", 8443, True))
    assert isinstance(first.tls, ssl.SSLContext)
    assert first.tls is second.tls
    assert dialing.dialer(("a.test", 443, True)) is first  # built once


@pytest.mark.parametrize(
    ("tls", "field", "message"),
    [
        ({"ca_file": "missing.pem"}, "ca_file", "cannot read"),
        ({"key_file": "client.key"}, "tls", "key_file needs cert_file"),
        ({"server_name": "a.test:443"}, "server_name", "without a port"),
    ],
    ids=["missing-file", "key-without-cert", "port"],
)
def test_unusable_tls_settings_stop_the_start_naming_the_field(
    certs: Certificates, tls: dict[str, Any], field: str, message: str
) -> None:
    url = "https://api.test"
    files = {name: str(certs.folder / value) for name, value in tls.items() if "file" in name}
    with pytest.raises(ValidationError) as raised:
        load_settings(**tls_settings(url, **{**tls, **files}))
    (error,) = raised.value.errors()
    assert error["loc"][:3] == ("upstreams", url, "tls"), error
    assert field in (*error["loc"], error["msg"]) or field == "tls", error
    assert message in error["msg"], error


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"cert_file": "ca.pem"}, "not a PEM certificate and its matching key"),
        ({"ca_file": "client.key"}, "no PEM CA certificate"),
    ],
    ids=["cert-without-key", "not-a-ca"],
)
def test_tls_files_that_do_not_load_stop_the_start_naming_the_upstream(
    certs: Certificates, tls: dict[str, str], message: str
) -> None:
    """The settings hold the paths (they are data); the start-up check builds the contexts."""
    url = "https://api.test"
    files = {name: str(certs.folder / value) for name, value in tls.items()}
    settings = load_settings(**tls_settings(url, **files))
    with pytest.raises(ConfigError, match=f"upstreams.{url}.tls: .*{message}"):
        Dialing.check(settings)
    with pytest.raises(ConfigError, match=message):
        Dialing.from_settings(settings)


def test_an_upstreams_entry_no_route_uses_is_an_error() -> None:
    with pytest.raises(ValidationError, match="is no route's upstream"):
        load_settings(upstream="https://api.test", upstreams={"https://typo.test": {}})


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("presented", [True, False], ids=["presented", "missing"])
def test_a_refused_client_certificate_is_a_connect_failure_on_both_loops(
    certs: Certificates, loop: str, presented: bool
) -> None:
    """The client alone, on asyncio's loop and on uvloop (which the proxy serves on): the
    upstream's TLS 1.3 alert is a connect failure, not a connection broken after sending."""
    context = certs.server_context(client_certificates=True)
    if presented:
        tls = UpstreamTlsSettings(
            ca_file=certs.ca_file, cert_file=certs.client_cert_file, key_file=certs.client_key_file
        )
    else:
        tls = UpstreamTlsSettings(ca_file=certs.ca_file)

    async def scenario() -> None:
        with BlockingTlsUpstream(context) as upstream:
            origin = ("127.0.0.1", int(upstream.url.rsplit(":", 1)[1]), True)
            client = UpstreamClient(
                timeout=2,
                connect_timeout=2,
                connections=2,
                keepalive=5,
                dialing=Dialing({origin: UpstreamSettings(tls=tls)}),
            )
            await client.open()
            try:
                request = client.request("POST", URL(upstream.url + "/pay"), {}, b"{}")
                if presented:
                    async with request as response:
                        assert response.status == 201
                else:
                    with pytest.raises(UpstreamFailure) as failure:
                        async with request:
                            pass
                    assert failure.value.failure is Failure.CONNECT, failure.value.reason
                    assert "TLSV13_ALERT_CERTIFICATE_REQUIRED" in failure.value.reason
                assert upstream.executed == int(presented)
            finally:
                await client.close()

    (uvloop.run if loop == "uvloop" else asyncio.run)(scenario())
