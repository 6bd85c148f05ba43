"""A store's close stops its wake-up feed even when the client library swallowed the
cancellation (store/feed.py).

redis-py's pub/sub can lose a cancellation: the feed listened on, and `close`, which cancels
the feed and waits for it, waited for ever; `idemproxy jobs delete --redis` hung after its work
was done. Here the loss is made certain: `PubSub.get_message` is wrapped to swallow it. (Were
the feed loop to stop honouring such a cancellation, `close` still ends, after its bound, and
this test fails rather than hangs.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from idemproxy.store.layers import StoreStack
from idemproxy.store.redis.cache import RedisCachedStore
from idemproxy.store.sqlite.store import SqliteStore
from tests.support.redisserver import RedisServer, wait_for


async def _subscribed(client: Redis) -> bool:
    channels: Any = await client.pubsub_channels()
    return bool(channels)


async def test_close_stops_a_feed_whose_cancellation_redis_py_swallowed(
    redis_server: RedisServer, redis_client: Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = PubSub.get_message
    swallowed: list[bool] = []

    async def losing(self: PubSub, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, *args, **kwargs)
        except asyncio.CancelledError:
            swallowed.append(True)
            return None  # what a library that loses a cancellation does

    monkeypatch.setattr(PubSub, "get_message", losing)
    inner = SqliteStore(str(tmp_path / "feed.db"))
    stack = StoreStack.of(RedisCachedStore.from_url(inner, redis_server.url))
    await stack.open()
    try:
        await wait_for(lambda: _subscribed(redis_client))
        await asyncio.sleep(0.1)  # the feed is waiting in get_message
        async with asyncio.timeout(5):
            await stack.close()
    finally:
        # Were the feed still running (the bug), end it here rather than hang the teardown:
        # without the wrapper, a second cancellation reaches it.
        monkeypatch.undo()
        feeds = {t for t in asyncio.all_tasks() if t.get_name() == "idemproxy-redis-feed"}
        for feed in feeds:
            feed.cancel()
        if feeds:
            await asyncio.wait(feeds, timeout=5)
    assert swallowed  # the cancellation did land in get_message, and was lost there
    assert not await _subscribed(redis_client)
