"""Building the proxy application (STYLE §8: dependencies injected, tests pass their own)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from idemproxy.config import Settings
from idemproxy.proxy.context import CONTEXT, ProxyContext
from idemproxy.proxy.failpoints import Failpoints
from idemproxy.proxy.forward import UpstreamClient
from idemproxy.proxy.handler import handle
from idemproxy.proxy.sweeper import sweep_forever
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store

log = logging.getLogger(__name__)


def create_app(settings: Settings, *, store: Store | None = None) -> web.Application:
    """The proxy app. An injected `store` is owned (opened, migrated, closed) by the caller."""
    app = web.Application(
        handler_args={
            "max_line_size": settings.server.max_line_size,
            "max_field_size": settings.server.max_field_size,
        },
    )
    app.cleanup_ctx.append(_lifecycle(settings, store))
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def _lifecycle(
    settings: Settings, injected: Store | None
) -> Callable[[web.Application], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        store = injected or create_store(
            settings.store,
            max_connections=settings.pool.store_connections,
            command_timeout=settings.pool.store_timeout,
        )
        if injected is None:
            await store.open()
            if settings.migrate:
                await store.migrate()
        failpoints = Failpoints.from_env()
        upstream = _upstream_client(settings, failpoints)
        await upstream.open()
        ctx = ProxyContext.build(settings, store, upstream, failpoints)
        app[CONTEXT] = ctx
        sweeper = asyncio.create_task(
            sweep_forever(
                store,
                interval=settings.sweeper.interval,
                batch_size=settings.sweeper.batch_size,
                unknown_ttl=settings.unknown_ttl,
            )
        )
        try:
            yield
        finally:
            await _drain(ctx, settings.server.shutdown_timeout)
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await upstream.close()
            if injected is None:
                await store.close()

    return lifecycle


def _upstream_client(settings: Settings, failpoints: Failpoints) -> UpstreamClient:
    return UpstreamClient(
        timeout=settings.upstream_timeout,
        connect_timeout=settings.connect_timeout,
        connections=settings.pool.upstream_connections,
        keepalive=settings.pool.upstream_keepalive,
        trace_configs=failpoints.trace_configs(),
    )


async def _drain(ctx: ProxyContext, timeout: float) -> None:
    """Let attempts in flight finish and store their outcome before the store closes.

    Attempts still running after `timeout` are cancelled: each marks its job `unknown` on the
    way out (the upstream may have executed it), never `released`.
    """
    if not ctx.attempts:
        return
    log.info("waiting up to %.0fs for %d attempts in flight", timeout, len(ctx.attempts))
    _done, pending = await asyncio.wait(set(ctx.attempts), timeout=timeout)
    if pending:
        log.warning("cutting off %d attempts still in flight at shutdown", len(pending))
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=5.0)
