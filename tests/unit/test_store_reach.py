"""The line a person reads when the store cannot be opened: which server, and why."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from idemproxy.errors import StoreUnavailable, StoreUnreachable
from idemproxy.store.factory import shown_store
from idemproxy.store.reach import cause, postgres_address, postgres_unreachable
from idemproxy.store.sqlite.store import SqliteStore


@pytest.mark.parametrize(
    ("dsn", "address"),
    [
        ("postgresql://u:pw@db.internal:6432/orders", "db.internal:6432/orders"),
        ("postgresql://u@db.internal/orders", "db.internal:5432/orders"),
        ("postgres://app@10.0.0.5", "10.0.0.5:5432/app"),
        ("postgresql://u@[::1]:5433/x", "[::1]:5433/x"),
        ("postgresql://u@a:5432,b:5433/x?target_session_attrs=read-write", "a:5432,b:5433/x"),
        ("postgresql:///orders", "localhost:5432/orders"),
    ],
)
def test_the_address_is_host_port_and_database_never_the_password(dsn: str, address: str) -> None:
    assert postgres_address(dsn) == address


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (ConnectionRefusedError(111, "Connection refused"), "connection refused"),
        (
            socket.gaierror(-2, "Name or service not known"),
            "host not found (Name or service not known)",
        ),
        (TimeoutError(), "no answer in time (timed out)"),
        (OSError(113, "No route to host"), "no route to host"),
        (RuntimeError('database "x" does not exist'), 'database "x" does not exist'),
    ],
)
def test_the_cause_as_a_person_says_it(error: BaseException, said: str) -> None:
    assert cause(error) == said


def test_still_a_store_unavailable_for_the_proxy_but_with_its_own_line() -> None:
    error = postgres_unreachable("postgresql://u:pw@h:1/d", ConnectionRefusedError())
    assert isinstance(error, StoreUnavailable)
    assert error.reason == "cannot reach PostgreSQL at h:1/d: connection refused"
    assert "h:1" not in error.detail  # the client's answer stays the generic one


async def test_a_sqlite_store_in_a_missing_directory_is_not_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = SqliteStore("data/idemproxy.db")
    with pytest.raises(StoreUnreachable) as caught:
        await store.open()
    assert caught.value.reason == (
        f"cannot open the SQLite store {tmp_path / 'data' / 'idemproxy.db'}:"
        " its directory does not exist"
    )
    assert not (tmp_path / "data").exists()


def test_the_store_is_shown_with_a_resolved_sqlite_path_and_no_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert shown_store("sqlite:///idemproxy.db") == f"sqlite:///{tmp_path / 'idemproxy.db'}"
    assert shown_store("sqlite:////var/lib/x.db") == "sqlite:////var/lib/x.db"
    assert shown_store("sqlite://:memory:") == "sqlite://:memory:"
    assert shown_store("postgresql://u:pw@h/d") == "postgresql://u:***@h/d"
