"""Tracing is an optional extra (`idemproxy[otel]`). Without the packages the proxy imports and
serves; asking for tracing then is a clear start-up error. With tracing off nothing of
opentelemetry is imported, even where it is installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from idemproxy.config.settings import load_settings
from idemproxy.errors import ConfigError
from idemproxy.proxy import tracing
from idemproxy.proxy.app import create_app, tracing_from_settings
from idemproxy.proxy.context import CONTEXT

UPSTREAM = "http://127.0.0.1:9"

# One governed request and one pass-through (both 502: nothing listens upstream) with tracing
# off, through the app as `idemproxy serve` builds it.
SERVE_TRACING_OFF = textwrap.dedent(
    """
    import asyncio
    from aiohttp.test_utils import TestClient, TestServer
    from idemproxy.config.settings import load_settings
    from idemproxy.proxy.app import create_app

    async def requests():
        settings = load_settings(upstream="http://127.0.0.1:9", store="sqlite://:memory:")
        async with TestClient(TestServer(create_app(settings))) as client:
            governed = await client.post("/p", data=b"x", headers={"Idempotency-Key": "k"})
            forwarded = await client.get("/p")
            assert (governed.status, forwarded.status) == (502, 502)

    asyncio.run(requests())
    """
)

WITHOUT_OTEL = (
    textwrap.dedent(
        """
    import importlib, os, pkgutil, sys
    sys.modules["opentelemetry"] = None  # as if `idemproxy[otel]` were not installed
    import idemproxy
    for info in pkgutil.walk_packages(idemproxy.__path__, "idemproxy."):
        if info.name not in ("idemproxy.__main__", "idemproxy.proxy.tracing"):
            importlib.import_module(info.name)
    """
    )
    + SERVE_TRACING_OFF
    + textwrap.dedent(
        """
    from idemproxy.cli.main import main
    os.environ["IDEMPROXY_TRACING__ENABLED"] = "true"
    code = main(["serve", "--upstream", "http://127.0.0.1:9", "--store", "sqlite://:memory:"])
    print("exit", code)
    """
    )
)

NOTHING_IMPORTED = SERVE_TRACING_OFF + textwrap.dedent(
    """
    import sys
    loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
    assert not loaded, loaded
    print("none imported")
    """
)


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )


def test_without_the_extra_the_proxy_serves_and_asking_for_tracing_fails_clearly() -> None:
    done = _run(WITHOUT_OTEL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("exit 2"), done.stdout
    assert "pip install 'idemproxy[otel]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_with_tracing_off_nothing_of_opentelemetry_is_imported() -> None:
    done = _run(NOTHING_IMPORTED)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "none imported"


def test_tracing_is_off_by_default_and_on_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert tracing_from_settings(load_settings(upstream=UPSTREAM)) is None
    monkeypatch.setenv("IDEMPROXY_TRACING__ENABLED", "true")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    on = tracing_from_settings(load_settings(upstream=UPSTREAM))
    assert isinstance(on, tracing.Tracing)


def test_a_negative_flush_timeout_is_refused() -> None:
    with pytest.raises(ValidationError, match="flush_timeout"):
        load_settings(upstream=UPSTREAM, tracing={"enabled": True, "flush_timeout": -1})


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("OTEL_TRACES_EXPORTER", "zipkin", "unknown exporter 'zipkin'"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "'http/json' is not supported"),
    ],
)
def test_an_exporter_it_cannot_make_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=message):
        tracing.Tracing.from_environment(flush_timeout=1.0)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_the_otlp_exporter_follows_the_protocol_variable(
    monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    exporter = tracing._otlp()
    assert protocol.partition("/")[0] in type(exporter).__module__
    exporter.shutdown()


def test_the_service_is_named_idemproxy_unless_the_environment_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=prod")
    resource = tracing.service_resource().attributes
    assert resource["service.name"] == "idemproxy"
    assert resource["deployment.environment.name"] == "prod"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=payments-proxy")
    assert tracing.service_resource().attributes["service.name"] == "payments-proxy"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge")
    assert tracing.service_resource().attributes["service.name"] == "edge"


@pytest.mark.parametrize("value", ["true", "TRUE", " True "])
def test_otel_sdk_disabled_turns_tracing_off(
    value: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK's own switch (OpenTelemetry's general SDK configuration) beats the setting."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", value)
    caplog.set_level("INFO")
    settings = load_settings(upstream=UPSTREAM, tracing={"enabled": True})
    assert tracing_from_settings(settings) is None
    assert "OTEL_SDK_DISABLED" in caplog.text


@pytest.mark.parametrize("value", ["false", "", "1"])
def test_otel_sdk_disabled_false_keeps_tracing(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", value)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    settings = load_settings(upstream=UPSTREAM, tracing={"enabled": True})
    assert isinstance(tracing_from_settings(settings), tracing.Tracing)


async def test_the_sdk_switch_is_logged_once_when_serve_hands_its_tracing_over(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """`idemproxy serve` reads the tracing settings before opening the store and hands the
    app what it got, None included: the app reads them no second time, and the start-up line
    (docs/operations.md, "Tracing") comes once."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    caplog.set_level("INFO")
    settings = load_settings(
        upstream=UPSTREAM, store=f"sqlite:///{tmp_path / 'jobs.db'}", tracing={"enabled": True}
    )
    spans = tracing_from_settings(settings)
    async with TestClient(TestServer(create_app(settings, tracing=spans))) as client:
        assert client.app[CONTEXT].tracing is None
    assert caplog.text.count("OTEL_SDK_DISABLED is true") == 1
