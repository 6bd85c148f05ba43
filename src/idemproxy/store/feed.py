"""The lifecycle of a store's change feed (PostgreSQL LISTEN, store/postgres/listen.py; Redis
pub/sub, store/redis/feed.py): a task that listens until its store closes.

redis-py's pub/sub can catch a cancellation and not re-raise it: the feed then listened on,
and a store's close, which cancelled its feed and waited for it, waited for ever
(`idemproxy jobs delete --redis` hung after its work was done). So the feed loops check
`raise_if_cancelled` every round, and a close waits for a feed only so long.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)
# A feed ends within a round of being cancelled: a 1 s tick, then a 1 s bounded unsubscribe
# or connection close.
STOP_SECONDS = 3.0


def raise_if_cancelled() -> None:
    """Re-raise a cancellation that a client library swallowed: `Task.cancelling()` still
    counts it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_feed(feed: asyncio.Task[None], *, timeout: float = STOP_SECONDS) -> None:
    """Cancel a feed and wait for it to end, for at most `timeout` seconds: one that does not
    stop must not hold up its store's close (and a process's exit) for ever."""
    feed.cancel()
    done, _ = await asyncio.wait({feed}, timeout=timeout)
    if not done:
        log.warning("%s did not stop within %.1fs; left behind", feed.get_name(), timeout)
    elif not feed.cancelled() and (error := feed.exception()) is not None:
        log.warning("%s had ended with %r", feed.get_name(), error)
