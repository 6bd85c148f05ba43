"""Invalid settings stop `idemproxy serve` at start-up with a message naming the field (SPEC §12),
whichever layer they come from: a flag, the environment or the YAML file.

In-process, through the command line's own entry point (`idemproxy.cli.main`): what a process
adds (its exit status and stderr) is checked once, by tests/e2e/test_config.py."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from idemproxy.cli.main import main


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port this test listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


INVALID = [
    (["--ttl", "-1"], {}, None, "ttl"),
    (["--listen", "nonsense"], {}, None, "listen"),
    (["--owner", "bogus"], {}, None, "owner.strategy"),
    (["--upstream", "ftp://x"], {}, None, "upstream"),
    (["--store", "mysql://db/idem"], {}, None, "store"),
    # SPEC §13: the admin API needs a token anywhere but loopback.
    (["--admin-listen", "0.0.0.0:9999"], {}, None, "admin"),
    ([], {"IDEMPROXY_LEASE": "soon"}, None, "lease"),
    ([], {"IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": "-1"}, None, "server.shutdown_timeout"),
    # SPEC §3.5: a renewal (due after lease / 3) that may take pool.store_timeout must fit.
    (["--lease", "7"], {}, None, "pool"),
    ([], {}, {"pool": {"lease_connections": 0}}, "pool.lease_connections"),
    ([], {}, {"bogus_key": 1}, "bogus_key"),
    ([], {}, {"owner": {"strateggy": "none"}}, "owner.strateggy"),
    ([], {}, {"routes": [{"prefix": "api", "upstream": "http://x"}]}, "routes.0.prefix"),
]


@pytest.mark.parametrize(
    ("flags", "env", "yaml_data", "field_name"), INVALID, ids=[case[-1] for case in INVALID]
)
def test_an_invalid_setting_stops_start_up_naming_the_field(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    env: dict[str, str],
    yaml_data: dict[str, Any] | None,
    field_name: str,
    taken: int,
) -> None:
    for name in [name for name in os.environ if name.startswith("IDEMPROXY_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    base = ["--upstream", "http://127.0.0.1:9", "--store", f"sqlite:///{tmp_path}/x.db"]
    # A port taken by the test: were the settings valid after all, the start would fail on it
    # at once (with another status), never serve.
    base += ["--listen", f"127.0.0.1:{taken}", "--admin-listen", f"127.0.0.1:{taken}"]
    if yaml_data is not None:
        config = tmp_path / "idemproxy.yaml"
        config.write_text(yaml.safe_dump(yaml_data))
        base += ["--config", str(config)]
    assert main(["serve", *base, *flags]) == 2
    err = capsys.readouterr().err
    assert f"idemproxy: invalid configuration: {field_name}: " in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "x.db").exists(), "nothing was started"
