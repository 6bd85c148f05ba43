"""Configuration of a real `serve` process (SPEC §12): YAML file < environment < flags, and
invalid values fail at start-up with a message that names the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import yaml

from tests.support.client import send

from .conftest import free_port

if TYPE_CHECKING:
    from .conftest import RunCli, StartBackend, StartProxy

pytestmark = pytest.mark.slow


def _write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_invalid_setting_stops_the_process_naming_the_field(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """What the process adds to the in-process table of invalid settings
    (tests/unit/test_config_startup.py): the status, stderr, an environment variable read."""
    base = ["--upstream", "http://127.0.0.1:9", "--store", f"sqlite:///{tmp_path}/x.db"]
    base += ["--listen", f"127.0.0.1:{free_port()}", "--admin-listen", f"127.0.0.1:{free_port()}"]
    done = run_cli("serve", *base, env={"IDEMPROXY_LEASE": "soon"}, timeout=20)
    assert done.returncode == 2, done
    assert "idemproxy: invalid configuration: lease: " in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "x.db").exists(), "nothing was started"


def test_a_missing_config_file_is_named(tmp_path: Path, run_cli: RunCli) -> None:
    missing = tmp_path / "nope.yaml"
    for args, env in [
        (["--config", str(missing)], {}),
        ([], {"IDEMPROXY_CONFIG": str(missing)}),  # the flag's default comes from the environment
    ]:
        done = run_cli("serve", "--upstream", "http://127.0.0.1:9", *args, env=env, timeout=20)
        assert done.returncode == 2, done
        assert f"invalid configuration: config: no such file: {missing}" in done.stderr
        assert "Traceback" not in done.stderr


def test_no_upstream_and_no_routes_is_named(run_cli: RunCli) -> None:
    done = run_cli("serve", "--store", "sqlite:///x.db", timeout=20)
    assert done.returncode == 2, done
    assert "invalid configuration: " in done.stderr
    assert "upstream" in done.stderr


@dataclass(frozen=True)
class Layer:
    """What a process with this configuration layer on top of the file should do."""

    env: dict[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    mismatch_status: int = 422  # profile
    replay_omitted: bool = True  # max_stored_body
    executions_for_two_tenants: int = 2  # owner.strategy
    status_without_tenant: int = 401  # owner.required


# The file: ietf profile, 50-byte stored bodies, owner from X-Tenant (required), two routes.
ENV = {
    "IDEMPROXY_PROFILE": "default",
    "IDEMPROXY_MAX_STORED_BODY": "100000",
    "IDEMPROXY_OWNER__STRATEGY": "none",
}
LAYERS = {
    "file": Layer(),
    "env-over-file": Layer(
        env=ENV,
        mismatch_status=409,
        replay_omitted=False,
        executions_for_two_tenants=1,
        status_without_tenant=201,
    ),
    # A nested flag (--owner) replaces owner.strategy only: owner.required stays from the file.
    "flags-over-env": Layer(
        env=ENV,
        flags=("--profile", "ietf", "--max-stored-body", "50", "--owner", "header:X-Tenant"),
    ),
}


@pytest.mark.parametrize("layer", LAYERS.values(), ids=LAYERS.keys())
async def test_file_then_environment_then_flags(
    layer: Layer, tmp_path: Path, start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    alpha, beta = await start_backend(), await start_backend()
    config = _write_yaml(
        tmp_path / "idemproxy.yaml",
        {
            "store": f"sqlite:///{tmp_path}/file.db",
            "profile": "ietf",
            "max_stored_body": 50,
            "owner": {"strategy": "header:X-Tenant", "required": True},
            "routes": [
                {"prefix": "/alpha", "upstream": alpha.url},
                {"prefix": "/beta", "upstream": beta.url},
            ],
        },
    )
    proxy = await start_proxy("--config", str(config), *layer.flags, env=layer.env)
    acme, globex = {"X-Tenant": "acme"}, {"X-Tenant": "globex"}
    async with aiohttp.ClientSession() as session:
        # Routes: two prefixes, two backends.
        first = await send(session, f"{proxy.url}/alpha/charges", key="k-alpha", headers=acme)
        await send(session, f"{proxy.url}/beta/charges", key="k-beta", headers=acme)
        assert first.status == 201, proxy.describe()
        assert [e.path_qs for e in alpha.ledger.executions] == ["/alpha/charges"]
        assert [e.path_qs for e in beta.ledger.executions] == ["/beta/charges"]

        # profile: a reused key with another payload.
        mismatch = await send(
            session, f"{proxy.url}/alpha/charges", key="k-alpha", body=b"{}", headers=acme
        )
        assert (mismatch.status, mismatch.error) == (layer.mismatch_status, "payload-mismatch")

        # max_stored_body: a 1000-byte answer, then its replay.
        big = f"{proxy.url}/alpha/files?size=1000"
        original = await send(session, big, key="k-big", headers=acme)
        replay = await send(session, big, key="k-big", headers=acme)
        assert (original.status, len(original.body)) == (201, 1000)
        assert (replay.status, replay.replayed) == (201, True)
        if layer.replay_omitted:
            assert (replay.body, replay.headers.get("Idempotency-Replay")) == (b"", "omitted")
        else:
            assert (replay.body, replay.headers.get("Idempotency-Replay")) == (original.body, None)

        # owner: two tenants with one key, then no tenant at all.
        for tenant in (acme, globex):
            await send(session, f"{proxy.url}/alpha/shared", key="k-shared", headers=tenant)
        assert alpha.ledger.count("k-shared") == layer.executions_for_two_tenants
        anonymous = await send(session, f"{proxy.url}/alpha/anonymous", key="k-anon")
        assert anonymous.status == layer.status_without_tenant

        async with session.get(f"{proxy.admin_url}/healthz") as health:
            assert health.status == 200  # the admin listener is where --admin-listen put it
    assert beta.ledger.count() == 1
