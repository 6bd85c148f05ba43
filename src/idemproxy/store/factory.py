"""Choosing the store implementation from the DSN (SPEC §11)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from idemproxy.errors import ConfigError
from idemproxy.store.base import Store

if TYPE_CHECKING:
    from idemproxy.config import Settings


def create_store(dsn: str, *, max_connections: int = 20, command_timeout: float = 5.0) -> Store:
    """`sqlite:///relative.db`, `sqlite:////absolute.db`, `sqlite://:memory:` or `postgresql://…`."""
    if dsn.startswith(("postgresql://", "postgres://")):
        from idemproxy.store.postgres import PostgresStore

        return PostgresStore(dsn, max_connections=max_connections, command_timeout=command_timeout)
    if dsn.startswith("sqlite://"):
        from idemproxy.store.sqlite import SqliteStore

        return SqliteStore(sqlite_path(dsn), busy_timeout=command_timeout)
    raise ConfigError(f"store: unsupported DSN scheme in {dsn.split(':', 1)[0]!r}")


def wrap_with_cache(store: Store, settings: Settings) -> Store:
    """`store` behind the Redis replay cache when `redis` is set (SPEC §11), else `store`.

    Redis is an optional extra (STYLE §9): its client is imported only here, only when asked for.
    """
    if settings.redis is None:
        return store
    try:
        from idemproxy.store.redis_cache import RedisCachedStore
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "redis":
            raise
        raise ConfigError(
            "redis: --redis needs the redis package: pip install 'idemproxy[redis]'"
        ) from exc
    options = settings.redis_options
    return RedisCachedStore.from_url(
        store,
        settings.redis,
        timeout=options.timeout,
        write_timeout=options.write_timeout,
        ttl=options.ttl,
        max_body=options.max_body,
    )


def sqlite_path(dsn: str) -> str:
    path = dsn.removeprefix("sqlite://")
    if path in ("", "/"):
        raise ConfigError("store: a sqlite DSN needs a path, e.g. sqlite:///idemproxy.db")
    if path in {":memory:", "/:memory:"}:
        return ":memory:"
    return path.removeprefix("/")
