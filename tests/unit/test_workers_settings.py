"""`server.workers`: precedence, bounds, refused with SQLite (its wake-ups are in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from idemproxy.cli.main import main
from idemproxy.config.settings import load_settings
from idemproxy.workers.role import WorkerRole

PG = "postgresql://u@127.0.0.1:5432/db"


def test_one_worker_by_default() -> None:
    assert load_settings(upstream="http://x:1").server.workers == 1


def test_file_then_environment_then_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "idemproxy.yaml"
    config.write_text(
        yaml.safe_dump({"upstream": "http://x:1", "store": PG, "server": {"workers": 2}})
    )
    assert load_settings(config).server.workers == 2
    monkeypatch.setenv("IDEMPROXY_SERVER__WORKERS", "3")
    assert load_settings(config).server.workers == 3
    assert load_settings(config, server={"workers": 4}).server.workers == 4


@pytest.mark.parametrize("workers", [0, -1, 65])
def test_out_of_bounds_is_refused(workers: int) -> None:
    with pytest.raises(ValidationError, match="workers"):
        load_settings(upstream="http://x:1", store=PG, server={"workers": workers})


def test_more_than_one_worker_needs_postgresql(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="more than one worker needs the PostgreSQL store"):
        load_settings(
            upstream="http://x:1", store=f"sqlite:///{tmp_path}/j.db", server={"workers": 2}
        )
    # One worker on SQLite stays the default set-up.
    assert load_settings(upstream="http://x:1", server={"workers": 1}).server.workers == 1


def test_the_flag_reaches_the_settings_and_sqlite_stops_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"sqlite:///{tmp_path}/j.db"
    code = main(["serve", "--upstream", "http://x:1", "--store", store, "--workers", "2"])
    assert code == 2
    assert (
        "server.workers: more than one worker needs the PostgreSQL store" in capsys.readouterr().err
    )
    assert main(["serve", "--upstream", "http://x:1", "--store", PG, "--workers", "0"]) == 2
    assert "server.workers" in capsys.readouterr().err


def test_a_role_survives_its_command_line_form() -> None:
    first = WorkerRole(0, 3, peers=("http://127.0.0.1:1", "http://127.0.0.1:2"))
    other = WorkerRole(2, 3, admin_fd=7)
    assert WorkerRole.from_arg(first.to_arg()) == first
    assert WorkerRole.from_arg(other.to_arg()) == other
    assert (first.public_admin, other.public_admin) == (True, False)
