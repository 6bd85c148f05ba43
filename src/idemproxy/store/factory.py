"""Choosing the store implementation from the DSN (SPEC §11)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from idemproxy.constants import DEFAULT_MAX_STORED_BODY
from idemproxy.errors import ConfigError
from idemproxy.redact import redact_url
from idemproxy.store.base import Store
from idemproxy.store.batching import DEFAULT_BATCH
from idemproxy.store.layers import Stacked, StoreStack

if TYPE_CHECKING:
    from idemproxy.config.settings import Settings
    from idemproxy.store.redis.cache import RedisCachedStore
    from idemproxy.store.seal.codec import EntryTags


def create_store(
    dsn: str,
    *,
    max_connections: int = 20,
    command_timeout: float = 5.0,
    late_bytes: int = DEFAULT_MAX_STORED_BODY,
    lease_connections: int = 0,
    batch: int = DEFAULT_BATCH,
) -> Store:
    """`sqlite:///relative.db`, `sqlite:////absolute.db`, `sqlite://:memory:` or `postgresql://…`.

    `late_bytes`: bytes of late responses kept per job in all (`max_stored_body`, SPEC §3.3).
    `lease_connections`: PostgreSQL connections reserved for lease renewals (a proxy's, SPEC
    §3.5); the operator tools run no attempts and need none.
    `batch`: at most this many concurrent claims (or completions) share one statement and one
    commit (store/batching.py); 1 sends each alone.
    """
    if _is_postgres(dsn):
        from idemproxy.store.postgres.store import Connections, PostgresStore

        return PostgresStore(
            dsn,
            connections=Connections(maximum=max_connections, lease=lease_connections),
            command_timeout=command_timeout,
            late_bytes=late_bytes,
            batch=batch,
        )
    if dsn.startswith("sqlite://"):
        from idemproxy.store.sqlite.store import SqliteStore

        return SqliteStore(
            sqlite_path(dsn), busy_timeout=command_timeout, late_bytes=late_bytes, batch=batch
        )
    raise ConfigError(f"store: unsupported DSN scheme in {dsn.split(':', 1)[0]!r}")


def command_store(dsn: str, *, max_connections: int = 20) -> Store:
    """The store of a command that only reads and writes jobs (`jobs …`, `migrate`): without
    PostgreSQL's change feed, which only a serving proxy follows (held duplicates, the replay
    cache's deletions). A feed cut off mid-connect as such a command exits left asyncpg's
    "Future exception was never retrieved" on its stderr."""
    if _is_postgres(dsn):
        from idemproxy.store.postgres.store import Connections, PostgresStore

        return PostgresStore(dsn, connections=Connections(maximum=max_connections), listen=False)
    return create_store(dsn, max_connections=max_connections)


def serving_store(settings: Settings) -> Stacked:
    """The store a proxy process serves from: the configured store, behind Redis when
    `redis.url` is set, behind the in-process replay cache when the store is PostgreSQL
    (SPEC §11)."""
    store: Stacked = create_store(
        settings.store,
        max_connections=settings.pool.store_connections,
        command_timeout=settings.pool.store_timeout,
        late_bytes=settings.max_stored_body,
        lease_connections=settings.pool.lease_connections,
        batch=settings.pool.store_batch,
    )
    store = wrap_with_cache(store, settings)
    options = settings.replay_cache
    # Only PostgreSQL announces every deletion to every process (its change feed).
    if _is_postgres(settings.store) and options.max_bytes > 0:
        from idemproxy.store.cache.memory import MemoryReplayCache

        store = MemoryReplayCache(
            store, max_bytes=options.max_bytes, max_body=options.max_body, ttl=options.ttl
        )
    return wrap_with_seal(store, settings)


def wrap_with_seal(store: Stacked, settings: Settings) -> Stacked:
    """`store` behind the sealing of responses when `encryption.keys` is set (SPEC §11), else
    `store`: outermost, so that no cache below ever sees a response in the clear; the store
    of record seals and opens with the same ring what the operators write and read there. A
    key ring that does not parse is a `ConfigError` at start-up."""
    keys = settings.encryption.keys
    if keys is None:
        return store
    from idemproxy.store.seal.codec import ResponseCodec
    from idemproxy.store.seal.keyring import parse_key_ring
    from idemproxy.store.seal.store import SealingStore

    ring = parse_key_ring(keys.get_secret_value())
    codec = ResponseCodec(ring, require_sealed=settings.encryption.require_sealed)
    sealing = SealingStore(store, codec)
    sealing.record.seal = codec
    return sealing


def _is_postgres(dsn: str) -> bool:
    return dsn.startswith(("postgresql://", "postgres://"))


def redis_layer(stack: StoreStack) -> RedisCachedStore | None:
    """The stack's Redis cache, if any. Its module is imported only by `wrap_with_cache`, when
    `redis.url` is set: without it there is no such layer, and importing the module to look
    for one would import the Redis client (and what that imports, OpenTelemetry among it where
    it is installed) into every process."""
    module = sys.modules.get("idemproxy.store.redis.cache")
    if module is None:
        return None
    layer: RedisCachedStore | None = stack.layer(module.RedisCachedStore)
    return layer


def wrap_with_cache(store: Stacked, settings: Settings) -> Stacked:
    """`store` behind the Redis replay cache when `redis.url` is set (SPEC §11), else `store`.

    Redis is an optional extra (`idemproxy[redis]`): its client is imported only here, only when
    asked for.
    """
    redis = settings.redis
    if redis.url is None:
        return store
    try:
        from idemproxy.store.redis.cache import RedisCachedStore, RedisCacheOptions
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "redis":
            raise
        raise ConfigError(
            "redis: --redis needs the redis package: pip install 'idemproxy[redis]'"
        ) from exc
    return RedisCachedStore.from_url(
        store,
        redis.url,
        RedisCacheOptions(
            timeout=redis.timeout,
            write_timeout=redis.write_timeout,
            ttl=redis.ttl,
            max_body=redis.max_body,
        ),
        _entry_tags(settings),
    )


def _entry_tags(settings: Settings) -> EntryTags | None:
    """With `encryption.keys`, the tags of Redis entries under the same ring (SPEC §11)."""
    keys = settings.encryption.keys
    if keys is None:
        return None
    from idemproxy.store.seal.codec import EntryTags
    from idemproxy.store.seal.keyring import parse_key_ring

    return EntryTags(parse_key_ring(keys.get_secret_value()))


def sqlite_path(dsn: str) -> str:
    path = dsn.removeprefix("sqlite://")
    if path in ("", "/"):
        raise ConfigError("store: a sqlite DSN needs a path, e.g. sqlite:///idemproxy.db")
    if path in {":memory:", "/:memory:"}:
        return ":memory:"
    return path.removeprefix("/")


def shown_store(dsn: str) -> str:
    """The store as a log line shows it: a SQLite file by its absolute path (a relative one
    depends on the working directory), a URL without its secrets."""
    if dsn.startswith("sqlite://"):
        path = sqlite_path(dsn)
        return dsn if path == ":memory:" else f"sqlite:///{Path(path).resolve()}"
    return redact_url(dsn)
