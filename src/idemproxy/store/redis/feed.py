"""Cross-replica wake-ups over Redis pub/sub (SPEC §2.3, §11), beside PostgreSQL's LISTEN.

Every replica publishes on `REDIS_CHANNEL` the id of each job it changed whose key a held
duplicate marked watched (as PostgreSQL NOTIFY only does for watched jobs), and subscribes to it
here: a message wakes this process's held duplicates of that job, which then re-read it from
the store. Wake-ups only shorten waits (a waiter re-reads at least every
`WAITER_RECHECK_SECONDS` anyway), so a lost message delays an answer but never loses it. The
feed reconnects with backoff and, once subscribed again, wakes every waiter to re-read. Each
tick it also retries the cache invalidations that could not reach Redis when they were made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from idemproxy.constants import REDIS_CHANNEL
from idemproxy.store.feed import raise_if_cancelled
from idemproxy.store.redis.client import REDIS_ERRORS, RedisCache
from idemproxy.store.watch import JobWatch

log = logging.getLogger("idemproxy.store.redis")
_TICK = 1.0  # seconds between checks when no message arrives
_PING_AFTER = 5.0  # seconds of silence before the feed asks the server whether it is there
_SILENCE_LIMIT = 12.0  # seconds without any answer before the connection is given up
_MAX_BACKOFF = 2.0


async def listen_forever(client: Redis, watch: JobWatch, cache: RedisCache) -> None:
    delay = 0.1
    while True:
        subscribed = await _listen_once(client, watch, cache)
        raise_if_cancelled()
        delay = 0.1 if subscribed else min(delay * 2, _MAX_BACKOFF)
        await asyncio.sleep(delay)


async def _listen_once(client: Redis, watch: JobWatch, cache: RedisCache) -> bool:
    """Subscribe and deliver messages until the connection fails; True if it got subscribed."""
    pubsub = client.pubsub()
    subscribed = False
    try:
        async with asyncio.timeout(_PING_AFTER):
            await pubsub.subscribe(REDIS_CHANNEL)
        subscribed = True
        cache.back()  # Redis answers: say so, whether or not a request comes (idemproxy_redis_up)
        await _pump(pubsub, watch, cache)
    except REDIS_ERRORS as exc:
        cache.lost("wake-up feed", exc)
    finally:
        with contextlib.suppress(*REDIS_ERRORS):
            async with asyncio.timeout(1.0):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
    return subscribed


async def _pump(pubsub: PubSub, watch: JobWatch, cache: RedisCache) -> None:
    loop = asyncio.get_running_loop()
    heard = pinged = loop.time()
    while True:
        raise_if_cancelled()  # a cancellation redis-py swallowed (store/feed.py)
        message = await pubsub.get_message(timeout=_TICK)
        now = loop.time()
        if message is not None:
            heard = now
            if not cache.up:  # an answer (a pong) after a failed call of the cache's own
                cache.back()
            _deliver(message, watch)
        elif now - heard > _SILENCE_LIMIT:
            raise TimeoutError("redis stopped answering the wake-up feed")
        elif now - max(heard, pinged) > _PING_AFTER:
            pinged = now
            await pubsub.ping()  # the answer arrives as a "pong" message
        if cache.has_drops:
            await cache.flush_drops()


def _deliver(message: dict[str, Any], watch: JobWatch) -> None:
    kind, data = message["type"], message["data"]
    if kind == "message":
        watch.notify(data.decode() if isinstance(data, bytes) else str(data))
    elif kind == "subscribe":
        # Subscribed (again): changes may have been missed before, so everyone re-reads.
        watch.notify_all()
