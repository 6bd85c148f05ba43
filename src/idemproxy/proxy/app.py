"""Building the proxy application : dependencies are injected, so tests pass their own."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from idemproxy.config.settings import Settings
from idemproxy.errors import ConfigError
from idemproxy.identity.intent import OwnerPolicy
from idemproxy.observe.metrics import (
    CollectorPauses,
    KeyFetchResult,
    Metrics,
    fold_forever,
    measure_loop_lag,
    refresh_gauges,
    watch_store,
)
from idemproxy.proxy.background.orphans import take_over_forever
from idemproxy.proxy.background.reconcile import start_reconciling
from idemproxy.proxy.background.sweeper import sweep_forever
from idemproxy.proxy.context import CONTEXT, ProxyContext, Services
from idemproxy.proxy.drain import drain
from idemproxy.proxy.failpoints import Failpoints
from idemproxy.proxy.handler import Proxy, expect_continue, handle
from idemproxy.proxy.jobs.governed import Governor
from idemproxy.proxy.server.any_path import AnyPath
from idemproxy.proxy.server.connection import (
    PROXY_ROUTE,
    ProxyRoute,
    note_started,
    own_server_header,
)
from idemproxy.proxy.upstream.client import UpstreamClient, UpstreamHooks
from idemproxy.proxy.upstream.contract import keep_checking
from idemproxy.proxy.upstream.dial import Dialing
from idemproxy.store.base import Store
from idemproxy.store.factory import serving_store
from idemproxy.store.layers import Stacked, StoreStack
from idemproxy.store.ports import Operators

if TYPE_CHECKING:  # imported only when tracing is on (the optional extra `idemproxy[otel]`)
    from idemproxy.proxy.tracing import Tracing

log = logging.getLogger(__name__)


class _FromSettings(enum.Enum):
    """`create_app`'s default for `tracing`: made from the settings as the app starts. A caller
    that made it already (`idemproxy serve`, before opening the store) passes what it got, None
    included, so that the settings are read, and their start-up line logged, once."""

    FROM_SETTINGS = enum.auto()


FROM_SETTINGS = _FromSettings.FROM_SETTINGS
# The process's store: the hot path, which the requests use, and the store of record.
STORES = web.AppKey("idemproxy.stores", StoreStack)


def create_app(
    settings: Settings,
    *,
    store: Stacked | None = None,
    metrics: Metrics | None = None,
    owner: OwnerPolicy | None = None,
    tracing: Tracing | _FromSettings | None = FROM_SETTINGS,
) -> web.Application:
    """The proxy app. An injected `store` (the outermost of its layers) is owned (opened,
    migrated, closed) by the caller; `metrics` are shared with the admin listener that serves
    them; `owner`, when not given, is built from `settings.owner` as the app starts, and so is
    `tracing` from `settings.tracing` (`tracing_from_settings`) unless given, None included.
    The app shuts its tracing down after the drain."""
    app = web.Application(
        handler_args={
            "max_line_size": settings.server.max_line_size,
            "max_field_size": settings.server.max_field_size,
            # RFC 9110 §8.4: a content coding is the client's and the backend's business. With
            # aiohttp's default a gzip body was decompressed here and went on still labelled
            # gzip (tests/proxy/test_content_coding.py).
            "auto_decompress": False,
        },
    )
    app.cleanup_ctx.append(
        _lifecycle(settings, store, metrics or Metrics.for_settings(settings), owner, tracing)
    )
    # Through the router only (aiohttp's own servers: tests, the demo): the listener of
    # `idemproxy serve` calls the proxy without it, and its writer does what these do, and says
    # `Connection: close` on the heads of a drain (proxy/server/connection.py).
    app.on_response_prepare.append(note_started)  # never a second response (connection.py)
    app.on_response_prepare.append(own_server_header(settings.server.server_token))
    app.router.register_resource(AnyPath(handle, expect_handler=expect_continue))
    return app


def tracing_from_settings(settings: Settings) -> Tracing | None:
    """OpenTelemetry tracing when `tracing.enabled` is set, else None; only then is anything of
    opentelemetry imported. Without the extra installed that is a start-up error."""
    if not settings.tracing.enabled:
        return None
    # The SDK's switch (OpenTelemetry's "General SDK Configuration"): off without a word from
    # the exporters, and without importing them.
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing: OTEL_SDK_DISABLED is true, so no spans are made or exported")
        return None
    try:
        from idemproxy.proxy.tracing import Tracing
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "opentelemetry":
            raise
        raise ConfigError(
            "tracing: tracing.enabled needs the OpenTelemetry packages: "
            "pip install 'idemproxy[otel]'"
        ) from exc
    return Tracing.from_environment(flush_timeout=settings.tracing.flush_timeout)


def _lifecycle(
    settings: Settings,
    injected: Stacked | None,
    metrics: Metrics,
    owner: OwnerPolicy | None,
    tracing: Tracing | _FromSettings | None,
) -> Callable[[web.Application], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # Whatever was opened is closed again, also when a later step fails (a bad contract
        # file, an unreadable JWT key): the exit stack unwinds in reverse order.
        async with contextlib.AsyncExitStack() as stack:
            stores = await _stores(settings, injected, stack)
            app[STORES] = stores
            failpoints = Failpoints.from_env()
            upstream = _upstream_client(settings, failpoints, metrics)
            await upstream.open()
            stack.push_async_callback(upstream.close)
            spans = tracing_from_settings(settings) if tracing is FROM_SETTINGS else tracing
            if spans is not None:
                stack.push_async_callback(spans.shutdown)  # after the drain: its last spans
            services = Services(failpoints, metrics, owner, spans)
            ctx = ProxyContext.build(settings, stores.jobs, upstream, services)
            stack.push_async_callback(ctx.offload.close)  # after the drain: no body left
            # After the drain, before the store: what they hold gets one more chance, both at
            # once, as long as a statement may wait for a connection.
            stack.push_async_callback(_close_follow_ups, ctx, settings.pool.store_timeout)
            app[CONTEXT] = ctx
            proxy = Proxy(ctx, Governor.of(ctx))
            app[PROXY_ROUTE] = ProxyRoute(proxy.answer, proxy.expect_continue)
            # SPEC §5: an identity provider's keys are fetched (once, bounded) before serving.
            await ctx.owner.start(_fetch_counter(metrics))
            stack.push_async_callback(ctx.owner.close)
            watch_store(metrics, stores)
            stack.enter_context(CollectorPauses(metrics.gc_pauses).installed())
            await _start_housekeeping(ctx, stores.record, stack)
            # A no-op after `idemproxy serve` drained; tests and the demo stop here.
            stack.push_async_callback(_drain_now, ctx)
            yield

    return lifecycle


def _fetch_counter(metrics: Metrics) -> Callable[[bool], None]:
    def count(fetched: bool) -> None:
        result = KeyFetchResult.SUCCEEDED if fetched else KeyFetchResult.FAILED
        metrics.key_fetch_result[result].inc()

    return count


async def _stores(
    settings: Settings, injected: Stacked | None, stack: contextlib.AsyncExitStack
) -> StoreStack:
    if injected is not None:
        return StoreStack.of(injected)
    stores = StoreStack.of(serving_store(settings))
    await stores.open()
    stack.push_async_callback(stores.close)
    if settings.migrate:
        await stores.record.migrate()
    return stores


async def _start_housekeeping(
    ctx: ProxyContext, record: Store, stack: contextlib.AsyncExitStack
) -> None:
    settings = ctx.settings
    # SPEC §3.4: fallbacks are eligible only once they passed their contract check.
    gates = [route.gate for route in ctx.routes.routes if route.gate is not None]
    await asyncio.gather(*(gate.check(ctx.upstream) for gate in gates))
    tasks = [
        asyncio.create_task(measure_loop_lag(ctx.metrics.event_loop_lag)),
        asyncio.create_task(fold_forever(ctx.metrics.folded)),
        asyncio.create_task(refresh_gauges(ctx.metrics, record, settings.sweeper.interval)),
        asyncio.create_task(keep_checking(gates, ctx.upstream)),
        asyncio.create_task(
            sweep_forever(
                record,
                interval=settings.sweeper.interval,
                batch_size=settings.sweeper.batch_size,
                unknown_ttl=settings.unknown_ttl,
            )
        ),
        asyncio.create_task(
            take_over_forever(
                record,
                ctx.store,  # the hot path: its layers announce a takeover as a request's
                interval=settings.sweeper.takeover_interval,
                lease=settings.lease,
                batch_size=settings.sweeper.batch_size,
                on_taken=_counted(ctx.metrics, record),
            )
        ),
    ]
    # SPEC §3.6: only with a route that names a reconcile endpoint.
    ctx.reconciler, reconciling = start_reconciling(
        settings, record, ctx.upstream, ctx.metrics.resolutions
    )
    tasks += reconciling
    stack.push_async_callback(_cancel, tasks)


def _counted(metrics: Metrics, store: Operators) -> Callable[[int], Awaitable[None]]:
    async def taken(count: int) -> None:
        metrics.orphans_taken_over.inc(count)
        # At once, not at the gauge's next refresh: operators alert on it (SPEC §13).
        metrics.unknown_jobs.set(await store.count_unknown())

    return taken


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close_follow_ups(ctx: ProxyContext, grace: float) -> None:
    await asyncio.gather(ctx.unsent.close(grace), ctx.unwritten.close(grace))


async def _drain_now(ctx: ProxyContext) -> None:
    await drain(ctx, asyncio.get_running_loop().time() + ctx.settings.server.shutdown_timeout)


def _upstream_client(
    settings: Settings, failpoints: Failpoints, metrics: Metrics
) -> UpstreamClient:
    return UpstreamClient(
        timeout=settings.upstream_timeout,
        connect_timeout=settings.connect_timeout,
        connections=settings.pool.upstream_connections,
        keepalive=settings.pool.upstream_keepalive,
        hooks=UpstreamHooks(
            on_sent=failpoints.on_sent(),
            on_headers_dropped=metrics.upstream_headers_dropped.inc,
        ),
        dialing=Dialing.from_settings(settings),
    )
