"""Running the proxy as a process: event loop, listeners, signals and graceful shutdown.

SIGTERM, SIGINT or SIGHUP (workers/role.py `STOP_SIGNALS`): /readyz turns 503, the proxy listener
stops accepting connections, idle kept-alive connections are closed and new governed requests on
busy ones get `503 shutting-down` (SPEC §8, proxy/drain.py), requests in flight get
`server.shutdown_timeout` to finish and store their outcome; attempts still running after that are
cancelled and their jobs become `unknown`, never `released` (SPEC §3.2).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web

from idemproxy.admin.app import Readiness, create_admin_app
from idemproxy.admin.peers import Peers
from idemproxy.config.settings import Settings, log_settings_warnings, parse_listen
from idemproxy.errors import ListenFailed, StoreUnreachable
from idemproxy.identity.intent import OwnerPolicy, log_owner_hint
from idemproxy.observe.logs import configure_logging
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.app import create_app, tracing_from_settings
from idemproxy.proxy.context import CONTEXT
from idemproxy.proxy.drain import close_connections, drain, start_draining
from idemproxy.proxy.server.connection import GuardedSite
from idemproxy.store.factory import redis_layer, serving_store, shown_store, sqlite_path
from idemproxy.store.layers import StoreStack
from idemproxy.workers.role import STOP_SIGNALS, WorkerRole

if TYPE_CHECKING:  # imported only when tracing is on (the optional extra `idemproxy[otel]`)
    from idemproxy.proxy.tracing import Tracing

log = logging.getLogger("idemproxy")
T = TypeVar("T")
_HANDLER_GRACE_SECONDS = 1.0
# A worker whose supervisor vanished (SIGKILL, OOM) drains instead of serving on unsupervised.
_PARENT_CHECK_SECONDS = 1.0
_YOUNG_COLLECTION_THRESHOLD = 10_000  # gc generation 0; the default is 700
_FIRST_STORE_PAUSE = 0.25  # seconds before the second try to open an unreachable store
_POSTGRES_SCHEMES = ("postgres://", "postgresql://")


def serve(settings: Settings, owner: OwnerPolicy, worker: WorkerRole | None = None) -> None:
    """One proxy process; `worker` when it is one of a supervisor's (`server.workers` > 1).
    `owner` is built from `settings.owner` before (identity/intent.py), so that a bad JWT key
    stops the start before the store is opened."""
    configure_logging(settings.log_level, settings.log_format)
    if worker is None:  # a supervisor's workers: the supervisor warned
        log_settings_warnings(settings)
        log_owner_hint(settings.owner)
        if settings.store.startswith("sqlite://") and sqlite_path(settings.store) == ":memory:":
            log.warning(_IN_MEMORY)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(run_server(settings, owner, worker))


_IN_MEMORY = (
    "store sqlite:///:memory: keeps jobs in this process's memory alone: a restart forgets "
    "every one, and a retry of a key that executed before it executes again; give a file "
    "(sqlite:///idemproxy.db) or PostgreSQL for anything but a try-out"
)


async def run_server(
    settings: Settings, owner: OwnerPolicy, worker: WorkerRole | None = None
) -> None:
    # Before the store is opened: tracing asked for without its packages stops the start.
    tracing = tracing_from_settings(settings)
    stores = await _open_when_reachable(settings)
    try:
        if settings.migrate:
            await stores.record.migrate()
        await _serve_until_signalled(settings, owner, stores, worker, tracing)
    finally:
        await stores.close()


async def _open_when_reachable(settings: Settings) -> StoreStack:
    """The serving store, opened (SPEC §11: with Redis and the in-process replay cache). A
    PostgreSQL server not reachable yet is tried again, each time with a store of its own, with
    a doubling pause for `store_start.max_wait` seconds: a database starting beside the proxy
    is not an orchestrator's crash loop (docs/deploy.md, Probes)."""
    wait = settings.store_start
    waits = settings.store.startswith(_POSTGRES_SCHEMES) and wait.max_wait > 0
    loop = asyncio.get_running_loop()
    give_up = loop.time() + wait.max_wait
    pause = _FIRST_STORE_PAUSE
    while True:
        stores = StoreStack.of(serving_store(settings))
        try:
            await stores.open()
            return stores
        except StoreUnreachable as exc:
            left = give_up - loop.time()
            if not waits or left <= 0:
                raise
            with contextlib.suppress(Exception):  # what the failed open left half-made
                await stores.close()
            pause = min(pause, left)
            log.warning(
                "%s; trying again in %.1f s (store_start.max_wait: %.0f s left)",
                exc.reason,
                pause,
                left,
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, wait.max_backoff)


async def _serve_until_signalled(
    settings: Settings,
    owner: OwnerPolicy,
    stores: StoreStack,
    worker: WorkerRole | None,
    tracing: Tracing | None,
) -> None:
    readiness = Readiness(owner_not_ready=owner.not_ready)
    metrics = Metrics.for_settings(settings)
    proxy = web.AppRunner(
        create_app(settings, store=stores.top, metrics=metrics, owner=owner, tracing=tracing),
        access_log=None,  # one log line per request costs more than the proxy itself
        handler_cancellation=False,  # SPEC §2: a client hanging up cancels nothing
        keepalive_timeout=settings.server.keepalive_timeout,
        # The drain below already waited for requests in flight; this is only a last grace.
        shutdown_timeout=_HANDLER_GRACE_SECONDS,
    )
    peers = Peers(worker.peers) if worker is not None and worker.peers else None
    redis_cache = redis_layer(stores)
    redis = None if redis_cache is None else redis_cache.cache
    admin = web.AppRunner(
        create_admin_app(
            settings, stores.record, readiness, metrics=metrics, peers=peers, invalidations=redis
        ),
        access_log=None,
    )
    await proxy.setup()
    await admin.setup()
    # Everything built so far lives as long as the process: keep it out of the collector's
    # full passes, which otherwise stop the event loop for ~100 ms every few thousand requests
    # (measured in bench/findings.md).
    gc.freeze()
    # Objects young enough for the collector's first generation are mostly those of requests in
    # flight, freed by reference counting when they end: a collection every 700 allocations
    # (the default) walks them again and again for little garbage. 10,000 leaves room for
    # every request in flight: collections per request 0.03 -> 0, 10 µs of CPU per request at
    # c=32 (bench/findings.md). Reference cycles are still collected, a little later.
    gc.set_threshold(_YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])
    # SPEC §9: the proxy listener cuts off slow request heads (proxy/server/connection.py).
    site = GuardedSite(
        proxy,
        settings.listen,
        settings.server,
        settings.limits,
        metrics,
        reuse_port=worker is not None,
    )
    # SPEC §8: a stop signal drains from the moment the proxy listens, not from the moment
    # start-up is over (its default action would kill a process already taking requests).
    stop = _stop_on_signals()
    try:
        await _listening("listen", settings.listen, site.start())
        admin_listen = settings.admin.listen
        admin_at = await _listening(
            "admin.listen", admin_listen, _start_admin(admin, admin_listen, worker)
        )
        log.info(
            "idemproxy %slistening on %s (admin %s), store %s",
            f"{worker.label()} " if worker is not None else "",
            settings.listen,
            admin_at,
            shown_store(settings.store),
        )
        await _until_stopped(stop, supervised=worker is not None)
        readiness.draining = True
        await _drain(proxy, site, settings.server.shutdown_timeout)
    finally:
        # The listener's connections are its own, not the runner's: closed before the app.
        await site.stop(_HANDLER_GRACE_SECONDS)
        await proxy.cleanup()
        await admin.cleanup()


async def _drain(proxy: web.AppRunner, site: GuardedSite, timeout: float) -> None:
    """No new connections or claims; then one deadline for every request and attempt in flight."""
    deadline = asyncio.get_running_loop().time() + timeout
    log.info("shutting down: draining requests in flight for up to %.1fs", timeout)
    ctx = proxy.app[CONTEXT]
    start_draining(ctx)
    site.close()
    await site.accepted()
    close_connections(site.server)
    await drain(ctx, deadline, site.server)


async def _listening(setting: str, address: str, start: Awaitable[T]) -> T:
    """`start`, with an address in use (or not this host's) as one line naming it (cli.main)."""
    try:
        return await start
    except OSError as exc:
        # asyncio's own message repeats the address; the errno's text is the news.
        code = exc.errno if not isinstance(exc, socket.gaierror) else None
        reason = os.strerror(code) if code else (exc.strerror or str(exc))
        raise ListenFailed(f"{setting}: cannot listen on {address}: {reason}") from exc


async def _start_admin(runner: web.AppRunner, listen: str, worker: WorkerRole | None) -> str:
    """The configured admin address, or a worker's loopback socket from its supervisor."""
    if worker is not None and worker.admin_fd is not None:
        sock = socket.socket(fileno=worker.admin_fd)
        await web.SockSite(runner, sock).start()
        host, port = sock.getsockname()[:2]
        return f"{host}:{port}, answered for by worker 0"
    host, port = parse_listen(listen)
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return listen


def _stop_on_signals() -> asyncio.Event:
    """Set by any of the stop signals from now on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop.set)
    return stop


async def _until_stopped(stop: asyncio.Event, *, supervised: bool = False) -> None:
    """Until a stop signal came, or, for a worker, its supervisor is gone."""
    if not supervised:
        await stop.wait()
        return
    parent = os.getppid()
    while not stop.is_set():
        if os.getppid() != parent:
            log.warning("the supervisor (pid %d) is gone: shutting down", parent)
            return
        # Polled: getppid() is the only portable way to notice a parent that was SIGKILLed.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _PARENT_CHECK_SECONDS)


def _loop_factory() -> type[asyncio.AbstractEventLoop] | None:
    if sys.platform == "win32":  # pragma: no cover
        return None
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return None
    return uvloop.Loop
