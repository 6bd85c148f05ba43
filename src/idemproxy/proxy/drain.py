"""Graceful shutdown of the proxy: one deadline for everything in flight (SPEC §3.2, §8).

From its start (`start_draining`) the proxy takes nothing new: a governed request that still
reaches it on a kept-alive connection is refused with `503 shutting-down` before any claim, a
held duplicate is answered the same way unless its job's result arrives first, idle kept-alive
connections are closed, and busy ones close after their response (`Connection: close`,
proxy/server/connection.py); a request whose body is still arriving is read, then refused. Requests
in flight (and those whose head had begun to arrive: each is read and answered), and the attempts
they run, get until the deadline to finish and store their outcome.
Attempts still running then are cancelled: each marks its job `unknown` on the way out (the
upstream may have executed it), never `released`.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.server.connection import close_idle_connections, requests_begun

log = logging.getLogger(__name__)
_POLL_SECONDS = 0.02
# Cancelled attempts get this long to write `unknown` before the store closes.
_SETTLE_SECONDS = 5.0


def start_draining(ctx: ProxyContext) -> None:
    """No new claims from now on; held duplicates are let go."""
    ctx.draining = True
    ctx.store.watch.wake_all()  # each re-reads its job once: the result, or 503 shutting-down


def close_connections(server: web.Server | None) -> None:
    """Idle kept-alive connections close now, busy ones after the response being handled."""
    if server is not None:
        close_idle_connections(server)


async def drain(ctx: ProxyContext, deadline: float, server: web.Server | None = None) -> None:
    """Wait, until `deadline`, for the requests in flight, the attempts they run and the
    requests of `server`'s connections begun before the drain; then cut off the attempts."""
    if ctx.drained:
        return
    loop = asyncio.get_running_loop()
    if ctx.in_flight.now or ctx.attempts:
        log.info(
            "draining %d requests and %d attempts for up to %.1fs",
            ctx.in_flight.now,
            len(ctx.attempts),
            max(deadline - loop.time(), 0.0),
        )
    # Polled: it runs once, at shutdown; an event would cost every request on the hot path.
    while _busy(ctx, server) and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(_POLL_SECONDS)
    pending = set(ctx.attempts)
    if pending:
        log.warning("cutting off %d attempts still in flight at shutdown", len(pending))
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=_SETTLE_SECONDS)
    ctx.drained = True


def _busy(ctx: ProxyContext, server: web.Server | None) -> bool:
    return bool(ctx.in_flight.now or ctx.attempts) or requests_begun(server)
