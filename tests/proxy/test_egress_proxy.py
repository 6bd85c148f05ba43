"""Upstreams through an egress proxy (`upstream_proxy`, `upstream_proxy_from_env`,
`upstreams.<url>.proxy`): an HTTP CONNECT tunnel, TLS inside it for https upstreams, against a
real CONNECT proxy on loopback that counts its tunnels (proxy/upstream/dial.py)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
from pydantic import ValidationError
from yarl import URL

from idemproxy.cli.main import main
from idemproxy.config.settings import load_settings
from idemproxy.config.upstream import UpstreamSettings, UpstreamTlsSettings
from idemproxy.core.types import JobState
from idemproxy.errors import ConfigError
from idemproxy.proxy.upstream.client import UpstreamClient
from idemproxy.proxy.upstream.dial import Dialing, EgressProxy, bypasses
from idemproxy.store.base import Store
from tests.support.proxychecks import KEY, assert_problem, only_job

from .conftest import ProxyFactory
from .upstream_leg import Certificates, ConnectProxy, Upstream

_PROXY_VARIABLES = ("https_proxy", "http_proxy", "all_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    yield


@pytest.fixture
def certs(tmp_path: Path) -> Certificates:
    return Certificates(tmp_path)


def through(
    upstream: Upstream, certs: Certificates | None = None, **settings: Any
) -> dict[str, Any]:
    upstreams = {}
    if certs is not None:
        upstreams[upstream.url] = {"tls": {"ca_file": str(certs.ca_file)}}
    return {"upstream": upstream.url, "upstreams": upstreams, **settings}


async def test_an_https_upstream_goes_through_a_tunnel_with_tls_inside(
    proxy: ProxyFactory, certs: Certificates, jobs: Store
) -> None:
    async with ConnectProxy() as egress, Upstream(certs.server_context()) as upstream:
        userinfo = egress.url.replace("http://", "http://gw:p%40ss@")
        client = await proxy(**through(upstream, certs, upstream_proxy=userinfo))
        for key in ("k1", "k2"):
            response = await client.post("/pay", json={}, headers={KEY: key})
            assert response.status == 201, await response.text()
    assert upstream.executed == 2
    assert egress.tunnels == 1  # the tunnel's connection is kept alive and reused
    authority = upstream.url.removeprefix("https://")
    assert egress.heads[0].startswith(f"CONNECT {authority} HTTP/1.1\r\n".encode())
    assert egress.header(0, "Host") == authority
    credentials = base64.b64encode(b"gw:p@ss").decode()
    assert egress.header(0, "Proxy-Authorization") == f"Basic {credentials}"


async def test_an_http_upstream_goes_through_a_tunnel_too(proxy: ProxyFactory) -> None:
    """CONNECT, not an absolute-form request: the upstream gets the request as sent, and an
    answer of the proxy is never taken for the upstream's."""
    async with ConnectProxy() as egress, Upstream() as upstream:
        client = await proxy(**through(upstream, upstream_proxy=egress.url))
        response = await client.post("/pay?x=%2F", json={}, headers={KEY: "k1"})
        assert response.status == 201, await response.text()
    assert (egress.tunnels, upstream.executed) == (1, 1)
    assert egress.header(0, "Proxy-Authorization") is None


async def test_a_refused_tunnel_is_a_connect_failure(
    proxy: ProxyFactory, certs: Certificates, jobs: Store
) -> None:
    async with (
        ConnectProxy(refuse="403 Forbidden") as egress,
        Upstream(certs.server_context()) as upstream,
    ):
        client = await proxy(**through(upstream, certs, upstream_proxy=egress.url))
        response = await client.post("/pay", json={}, headers={KEY: "k1"})
        await assert_problem(response, "upstream-unavailable", 502)
        job = await only_job(jobs)
        assert job.state is JobState.RELEASED, job.attempts[0].error
        assert "refused CONNECT" in (job.attempts[0].error or "")
        assert "403 Forbidden" in (job.attempts[0].error or "")
    assert (egress.tunnels, upstream.executed) == (0, 0)


async def test_a_refusal_reason_is_escaped_where_it_is_logged_and_stored(
    proxy: ProxyFactory, certs: Certificates, jobs: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The egress proxy's reason phrase is a peer's bytes: a control character in it (an ANSI
    escape, a bare CR, a NUL that PostgreSQL text refuses) is written escaped, as other text
    from an upstream is, in the attempt's error and in the log."""
    reason = "403 Go\x1b[2J\rAway\x00"
    async with (
        ConnectProxy(refuse=reason) as egress,
        Upstream(certs.server_context()) as upstream,
    ):
        client = await proxy(**through(upstream, certs, upstream_proxy=egress.url))
        with caplog.at_level("DEBUG"):
            response = await client.post("/pay", json={}, headers={KEY: "k1"})
        await assert_problem(response, "upstream-unavailable", 502)
        error = (await only_job(jobs)).attempts[0].error or ""
    assert "refused CONNECT" in error
    assert "403 Go\\x1b[2J\\rAway\\x00" in error, error
    logged = [r.getMessage() for r in caplog.records if "refused CONNECT" in r.getMessage()]
    assert logged, "the refusal is logged"
    for text in (error, *logged):
        assert all(ch.isprintable() for ch in text), repr(text)


async def test_an_upstream_with_proxy_none_is_reached_directly(proxy: ProxyFactory) -> None:
    async with ConnectProxy() as egress, Upstream() as upstream:
        client = await proxy(
            upstream=upstream.url,
            upstream_proxy=egress.url,
            upstreams={upstream.url: {"proxy": "none"}},
        )
        assert (await client.post("/pay", json={}, headers={KEY: "k1"})).status == 201
    assert (egress.tunnels, upstream.executed) == (0, 1)


@pytest.mark.parametrize(
    ("from_env", "no_proxy", "tunnels"),
    [
        (True, None, 1),
        (True, "localhost,127.0.0.1", 0),
        (True, ".example.com", 1),
        (False, None, 0),
    ],
    ids=["from-env", "no-proxy", "no-proxy-elsewhere", "env-ignored-by-default"],
)
async def test_the_environment_is_honoured_only_when_asked(
    proxy: ProxyFactory,
    certs: Certificates,
    monkeypatch: pytest.MonkeyPatch,
    from_env: bool,
    no_proxy: str | None,
    tunnels: int,
) -> None:
    async with ConnectProxy() as egress, Upstream(certs.server_context()) as upstream:
        monkeypatch.setenv("HTTPS_PROXY", egress.url)
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # not for an https upstream
        if no_proxy is not None:
            monkeypatch.setenv("NO_PROXY", no_proxy)
        client = await proxy(**through(upstream, certs, upstream_proxy_from_env=from_env))
        response = await client.post("/pay", json={}, headers={KEY: "k1"})
        assert response.status == 201, await response.text()
    assert (egress.tunnels, upstream.executed) == (tunnels, 1)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_tls_inside_a_tunnel_on_both_loops(certs: Certificates, loop: str) -> None:
    """The upstream client alone on uvloop too, which the proxy serves on (start_tls on a
    tunnel's transport)."""

    async def scenario() -> None:
        async with ConnectProxy() as egress, Upstream(certs.server_context()) as upstream:
            origin = ("127.0.0.1", int(upstream.url.rsplit(":", 1)[1]), True)
            tls = UpstreamSettings(tls=UpstreamTlsSettings(ca_file=certs.ca_file))
            dialing = Dialing({origin: tls}, proxy=EgressProxy.from_url(egress.url))
            client = UpstreamClient(
                timeout=2, connect_timeout=2, connections=2, keepalive=5, dialing=dialing
            )
            await client.open()
            try:
                for _ in range(2):
                    request = client.request("POST", URL(upstream.url + "/pay"), {}, b"{}")
                    async with request as response:
                        assert response.status == 201
                        await UpstreamClient.read_body(response, 1024)
            finally:
                await client.close()
            assert (egress.tunnels, upstream.executed) == (1, 2)

    (uvloop.run if loop == "uvloop" else asyncio.run)(scenario())


@pytest.mark.parametrize(
    ("entries", "host", "port", "bypassed"),
    [
        ("*", "api.example.com", 443, True),
        ("example.com", "example.com", 443, True),
        ("example.com", "api.example.com", 443, True),
        (".example.com", "api.example.com", 443, True),
        ("*.example.com", "api.example.com", 443, True),
        ("example.com", "badexample.com", 443, False),
        ("api.example.com", "example.com", 443, False),
        ("Example.COM.", "api.example.com", 443, True),
        ("example.com:8443", "api.example.com", 8443, True),
        ("example.com:8443", "api.example.com", 443, False),
        ("10.0.0.0/8", "10.1.2.3", 80, True),
        ("10.1.2.3", "10.1.2.3", 80, True),
        ("10.1.2.3:80", "10.1.2.3", 443, False),
        ("10.0.0.0/8", "11.1.2.3", 80, False),
        ("::1", "::1", 443, True),
        ("[::1]:443", "::1", 443, True),
        ("fd00::/8", "fd12::1", 443, True),
        ("localhost, 127.0.0.1", "127.0.0.1", 80, True),
        ("", "example.com", 443, False),
    ],
)
def test_no_proxy_reads_as_curl_does(entries: str, host: str, port: int, bypassed: bool) -> None:
    parsed = tuple(entry.strip() for entry in entries.split(",") if entry.strip())
    assert bypasses(parsed, host, port) is bypassed


@pytest.mark.parametrize(
    "url", ["https://proxy:3128", "socks5://proxy:1080", "http://proxy:x", "http://proxy:3128/p"]
)
def test_an_unusable_upstream_proxy_stops_the_start(url: str) -> None:
    with pytest.raises(ValidationError) as raised:
        load_settings(upstream="http://a:1", upstream_proxy=url)
    assert raised.value.errors()[0]["loc"] == ("upstream_proxy",)
    assert "proxy:3128" not in str(raised.value.errors()[0]["msg"])


def test_an_unusable_proxy_in_the_environment_stops_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "socks5://proxy:1080")
    settings = load_settings(upstream="https://a.test", upstream_proxy_from_env=True)
    with pytest.raises(ConfigError, match="HTTPS_PROXY"):
        Dialing.from_settings(settings)


def test_serve_refuses_an_unusable_proxy_in_the_environment_before_the_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("https_proxy", "socks5://proxy:1080")
    monkeypatch.setenv("IDEMPROXY_UPSTREAM_PROXY_FROM_ENV", "true")
    store = tmp_path / "never" / "j.db"
    code = main(["serve", "--upstream", "https://a.test", "--store", f"sqlite:///{store}"])
    assert code == 2
    assert (
        "https_proxy (upstream_proxy_from_env): must be an http:// URL" in capsys.readouterr().err
    )
    assert not store.parent.exists()


async def test_a_handshake_refused_inside_the_tunnel_is_a_connect_failure(
    proxy: ProxyFactory, certs: Certificates, jobs: Store
) -> None:
    async with ConnectProxy() as egress, Upstream(certs.server_context()) as upstream:
        client = await proxy(
            upstream=upstream.url,
            upstream_proxy=egress.url,
            upstreams={upstream.url: {"tls": {"ca_file": str(certs.other_ca_file)}}},
        )
        response = await client.post("/pay", json={}, headers={KEY: "k1"})
        await assert_problem(response, "upstream-unavailable", 502)
        assert (await only_job(jobs)).state is JobState.RELEASED
    assert (egress.tunnels, upstream.executed) == (1, 0)
