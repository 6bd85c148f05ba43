"""The PostgreSQL change feed: `LISTEN idemproxy_jobs` on a connection of its own (SPEC §11).

Every job change that matters to a waiter is sent with `pg_notify` in the same statement that
makes it, and delivered at commit to every replica. The feed reconnects with backoff; after any
gap it wakes every waiter so that they re-read their jobs themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import asyncpg

from idemproxy.constants import CLOCK_MARGIN_SECONDS, NOTIFY_CHANNEL
from idemproxy.store.feed import raise_if_cancelled
from idemproxy.store.watch import JobWatch

log = logging.getLogger(__name__)
_FEED_ERRORS = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    TimeoutError,
)
_SERVER_CLOCK = "SELECT extract(epoch FROM clock_timestamp())"
# A silent server is noticed within this many seconds.
_HEARTBEAT_SECONDS = 5.0


async def listen_forever(dsn: str, watch: JobWatch, *, timeout: float) -> None:
    delay = 0.1
    while True:
        raise_if_cancelled()  # one a driver swallowed still ends the feed (store/feed.py)
        try:
            conn = await asyncpg.connect(dsn, timeout=timeout)
        except _FEED_ERRORS as exc:
            log.warning("change feed: cannot connect (%s); retrying in %.1fs", exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        delay = 0.1
        await _listen_on(conn, watch, timeout)
        watch.notify_all()


async def _listen_on(conn: asyncpg.Connection, watch: JobWatch, timeout: float) -> None:
    lost = asyncio.Event()
    conn.add_termination_listener(lambda _conn: lost.set())

    def on_notify(_conn: object, _pid: int, _channel: str, payload: object) -> None:
        watch.notify(str(payload))

    try:
        async with asyncio.timeout(timeout):  # bounded, like the heartbeat below
            await conn.add_listener(NOTIFY_CHANNEL, on_notify)
        await _clock_offset(conn, watch, timeout)
        watch.live = True
        watch.notify_all()  # changes may have been missed before LISTEN took effect
        while not lost.is_set() and not conn.is_closed():
            raise_if_cancelled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_HEARTBEAT_SECONDS):
                    await lost.wait()
            if not lost.is_set():
                # Bounded: a frozen or unreachable server must count as lost, not hang the feed.
                await _clock_offset(conn, watch, timeout)
    except _FEED_ERRORS as exc:
        log.warning("change feed lost: %s", exc)
    finally:
        # From here until LISTEN is back, changes may pass unseen (the caller wakes everyone).
        watch.live = False
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), timeout=1.0)


async def _clock_offset(conn: asyncpg.Connection, watch: JobWatch, timeout: float) -> None:
    """Measure the server's clock minus ours, to within half a round trip; a round trip too
    slow for the caches' margin (constants.CLOCK_MARGIN_SECONDS) leaves the last measurement."""
    before = time.monotonic(), time.time()
    server = await conn.fetchval(_SERVER_CLOCK, timeout=timeout)
    after = time.monotonic(), time.time()
    if after[0] - before[0] <= CLOCK_MARGIN_SECONDS:
        watch.clock_offset = float(server) - (before[1] + after[1]) / 2
