"""Building the proxy application (STYLE §8: dependencies injected, tests pass their own)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from idemproxy.config import Settings
from idemproxy.metrics import Metrics, refresh_gauges, watch_store
from idemproxy.proxy.context import CONTEXT, ProxyContext
from idemproxy.proxy.contract import keep_checking
from idemproxy.proxy.drain import drain
from idemproxy.proxy.failpoints import Failpoints
from idemproxy.proxy.forward import UpstreamClient
from idemproxy.proxy.handler import handle
from idemproxy.proxy.sweeper import sweep_forever
from idemproxy.store.base import Store
from idemproxy.store.factory import create_store, wrap_with_cache

log = logging.getLogger(__name__)


def create_app(
    settings: Settings, *, store: Store | None = None, metrics: Metrics | None = None
) -> web.Application:
    """The proxy app. An injected `store` is owned (opened, migrated, closed) by the caller;
    `metrics` are shared with the admin listener that serves them."""
    app = web.Application(
        handler_args={
            "max_line_size": settings.server.max_line_size,
            "max_field_size": settings.server.max_field_size,
        },
    )
    app.cleanup_ctx.append(_lifecycle(settings, store, metrics or Metrics()))
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def _lifecycle(
    settings: Settings, injected: Store | None, metrics: Metrics
) -> Callable[[web.Application], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        store = injected or wrap_with_cache(
            create_store(
                settings.store,
                max_connections=settings.pool.store_connections,
                command_timeout=settings.pool.store_timeout,
            ),
            settings,
        )
        if injected is None:
            await store.open()
            if settings.migrate:
                await store.migrate()
        failpoints = Failpoints.from_env()
        upstream = _upstream_client(settings, failpoints)
        await upstream.open()
        ctx = ProxyContext.build(settings, store, upstream, failpoints, metrics)
        app[CONTEXT] = ctx
        watch_store(metrics, store)
        gauges = asyncio.create_task(refresh_gauges(metrics, store, settings.sweeper.interval))
        # SPEC §3.4: fallbacks are eligible only once they passed their contract check.
        gates = [route.gate for route in ctx.routes.routes if route.gate is not None]
        await asyncio.gather(*(gate.check(upstream) for gate in gates))
        checker = asyncio.create_task(keep_checking(gates, upstream))
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
            # A no-op after `idemproxy serve` drained; tests and the demo stop here.
            await drain(ctx, asyncio.get_running_loop().time() + settings.server.shutdown_timeout)
            checker.cancel()
            gauges.cancel()
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
