"""Choosing the store implementation from the DSN (SPEC §11)."""

from __future__ import annotations

from idemproxy.errors import ConfigError
from idemproxy.store.base import Store


def create_store(dsn: str, *, max_connections: int = 20, command_timeout: float = 5.0) -> Store:
    """`sqlite:///relative.db`, `sqlite:////absolute.db`, `sqlite://:memory:` or `postgresql://…`."""
    if dsn.startswith(("postgresql://", "postgres://")):
        from idemproxy.store.postgres import PostgresStore

        return PostgresStore(dsn, max_connections=max_connections, command_timeout=command_timeout)
    if dsn.startswith("sqlite://"):
        from idemproxy.store.sqlite import SqliteStore

        return SqliteStore(sqlite_path(dsn), busy_timeout=command_timeout)
    raise ConfigError(f"store: unsupported DSN scheme in {dsn.split(':', 1)[0]!r}")


def sqlite_path(dsn: str) -> str:
    path = dsn.removeprefix("sqlite://")
    if path in ("", "/"):
        raise ConfigError("store: a sqlite DSN needs a path, e.g. sqlite:///idemproxy.db")
    if path in {":memory:", "/:memory:"}:
        return ":memory:"
    return path.removeprefix("/")
