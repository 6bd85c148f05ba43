"""Whether an operator's change reached the proxies' Redis (SPEC §11, Erasure).

A delete or purge drops each job's Redis entry first; when Redis cannot take it, the entry is
kept pending and retried (store/redis/client.py). A proxy retries every second for as long as
it runs, but the operator who asked must hear that the erasure is not whole yet: the CLI exits 1
and the admin API answers 202, each naming the entries left.
"""

from __future__ import annotations

import asyncio
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

# Further tries, a second apart, before the entries left are reported (Redis restarting, a
# failover): what the operator waits at most.
TRIES = 3
_PAUSE_SECONDS = 1.0


class PendingInvalidations(Protocol):
    """What store/redis/client.py `RedisCache` says of the invalidations it holds."""

    @property
    def drops_made(self) -> int: ...

    async def flush_drops(self) -> bool: ...

    def pending_between(self, since: int, until: int) -> list[str]: ...


def mark(cache: PendingInvalidations | None) -> int:
    """Where an operator's change begins, and where it ends: the entries it leaves pending are
    those asked for between the two (others' left pending before, or asked for while it waits
    for Redis, are not its own)."""
    return 0 if cache is None else cache.drops_made


async def invalidations_left(
    cache: PendingInvalidations | None, since: int = 0, until: int | None = None
) -> list[str]:
    """The Redis entries asked for after `since` and up to `until` (the change's two marks;
    None: everything asked for so far) whose invalidation did not go through after `TRIES`
    more tries (none without Redis)."""
    if cache is None:
        return []
    end = cache.drops_made if until is None else until
    for _ in range(TRIES):
        await cache.flush_drops()
        if not cache.pending_between(since, end):
            return []
        await asyncio.sleep(_PAUSE_SECONDS)
    return cache.pending_between(since, end)


def unsent_remedy(entries: list[str], redis_url: str) -> str:
    """What the CLI says of a delete, purge or resolution whose entries Redis did not take:
    the proxies replay them until `redis.ttl` runs out, and the command, unlike a proxy, does
    not stay to send them later."""
    return (
        f"the store is changed, but Redis did not take the invalidation of "
        f"{len(entries)} cache entries: the proxies may replay them until redis.ttl runs out, "
        f"and a proxy that replayed one keeps it in memory up to replay_cache.ttl more. Once "
        f"Redis answers, remove them (with its password, if it has one): "
        f"{redis_cli(redis_url)} unlink {' '.join(entries)}"
    )


def redis_cli(url: str) -> str:
    """`redis-cli` with the server and database of a Redis URL as redis-py reads it: the
    database from `?db=`, else the path of a `redis://` URL; a `unix://` URL's path is its
    socket. Never the password."""
    parts = urlsplit(url)
    database = parse_qs(parts.query).get("db", [""])[0]
    if parts.scheme == "unix":
        where = f"-s {parts.path}"
    else:
        database = database or parts.path.strip("/")
        where = f"-h {parts.hostname or 'localhost'} -p {parts.port or 6379}"
        where += " --tls" if parts.scheme == "rediss" else ""
    return f"redis-cli {where} -n {database or '0'}"
