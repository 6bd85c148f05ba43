"""The admin application, on a listener of its own (SPEC §13)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from idemproxy.admin.jobs import add_jobs_routes, client_max_size
from idemproxy.admin.peers import Peers, merge_metrics
from idemproxy.config.settings import Settings
from idemproxy.errors import StoreUnavailable, Unauthorized
from idemproxy.http.problems import problem_response
from idemproxy.observe.metrics import Metrics, metrics_handler
from idemproxy.ops.invalidations import PendingInvalidations
from idemproxy.proxy.server.connection import own_server_header
from idemproxy.store.ports import Lifecycle, Operators


def _nothing_missing() -> str | None:
    return None


@dataclass(slots=True)
class Readiness:
    """Ready once started, not ready while draining (so load balancers stop sending)."""

    draining: bool = False
    reasons: list[str] = field(default_factory=list)
    # Why requests with a credential cannot be scoped yet: no identity provider's keys (SPEC §5).
    owner_not_ready: Callable[[], str | None] = _nothing_missing


class AdminStore(Operators, Lifecycle, Protocol):
    """The admin API's store: the operators' interface (SPEC §3.3, §11 erasure) and the ping
    of /readyz."""


READINESS = web.AppKey("idemproxy.admin.readiness", Readiness)
PEERS = web.AppKey("idemproxy.admin.peers", Peers)
# Probes and scrapers cannot easily send a secret header; none of these reveal a job or a
# response. The jobs API always needs the token when one is configured.
_OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# How long /readyz asks the store before it reports it unavailable (it is reported, never a
# reason to be unready: docs/deploy.md, Probes).
READY_STORE_CHECK_SECONDS = 0.5


def create_admin_app(
    settings: Settings,
    store: AdminStore,
    readiness: Readiness,
    *,
    metrics: Metrics | None = None,
    peers: Peers | None = None,
    invalidations: PendingInvalidations | None = None,
) -> web.Application:
    """`peers`: the other workers' admin apps, when this one answers for all (admin/peers.py);
    `invalidations`: the Redis cache's, when there is one (SPEC §11, Erasure)."""
    token = settings.admin.token.get_secret_value() if settings.admin.token else None
    app = web.Application(
        middlewares=[_bearer_auth(token)] if token else [],
        client_max_size=client_max_size(settings),
    )
    app[STORE_CHECK] = check = StoreCheck(store)
    app.on_cleanup.append(lambda _app: check.close())
    app[READINESS] = readiness
    app.on_response_prepare.append(own_server_header(settings.server.server_token))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    if peers is not None:
        app[PEERS] = peers
        app.cleanup_ctx.append(_peers_session)
    if metrics is not None:
        handler = metrics_handler(metrics) if peers is None else _all_workers_metrics(metrics)
        app.router.add_get("/metrics", handler)
    add_jobs_routes(
        app, settings, store, invalidations
    )  # SPEC §3.3: behind the token, like every other path
    return app


def _bearer_auth(token: str) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in _OPEN_PATHS:
            return await handler(request)
        if not hmac.compare_digest(_credential(request), expected):  # no token oracle
            response = problem_response(Unauthorized())
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    return bearer_auth


def _credential(request: web.Request) -> bytes:
    """The one Authorization value as the bytes that came in; b"" when absent or repeated.

    aiohttp decodes header bytes with surrogateescape: a non-ASCII byte must be encoded back the
    same way (a plain `.encode()` raised, a 500 with a traceback), and compared as bytes.
    """
    values = request.headers.getall("Authorization", [])
    if len(values) != 1:  # two tokens, one right: which one the server checked is no answer
        return b""
    return values[0].encode("utf-8", "surrogateescape")


async def _healthz(_request: web.Request) -> web.Response:
    """Liveness: the process answers. Never depends on the store (no restart storms)."""
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    """Readiness: the owner's keys are loaded and the process is not draining. The store is
    reported, not required: while it is down, governed requests fail closed (503) but
    pass-through traffic still flows, and taking the pod out of its Service would stop that too
    (docs/deploy.md, Probes)."""
    readiness = request.app[READINESS]
    if readiness.draining:
        return web.json_response({"status": "draining"}, status=503)
    if readiness.owner_not_ready() is not None:
        return web.json_response({"status": "identity-unavailable"}, status=503)
    peers = request.app.get(PEERS)
    if peers is not None and (worker := await peers.first_not_ready()) is not None:
        return web.json_response({"status": "worker-not-ready", "worker": worker}, status=503)
    store = await request.app[STORE_CHECK].state()
    return web.json_response({"status": "ready", "store": store})


class StoreCheck:
    """What the store's ping says (`ok`; `read-only`: it answers, but every claim would fail;
    `unavailable`: it does not answer), said within READY_STORE_CHECK_SECONDS. A stalled
    server holds a ping for `pool.store_timeout` (a cancelled statement's connection is only
    released once the server acknowledges, store/postgres/), past a probe's own timeout
    (Kubernetes: 1 s by default), and a failed probe pulls the pod all the same: the ping is
    not cancelled but left to finish on its own bound, and probes meanwhile share it."""

    def __init__(self, store: Lifecycle) -> None:
        self._store = store
        self._ping: asyncio.Task[bool] | None = None

    async def state(self) -> str:
        if self._ping is None or self._ping.done():
            self._ping = asyncio.create_task(self._store.ping(), name="idemproxy-ready-ping")
            self._ping.add_done_callback(_seen)
        ping = self._ping
        done, _ = await asyncio.wait({ping}, timeout=READY_STORE_CHECK_SECONDS)
        if not done or ping.cancelled() or ping.exception() is not None:
            return "unavailable"
        return "ok" if ping.result() else "read-only"

    async def close(self) -> None:
        if self._ping is not None and not self._ping.done():
            self._ping.cancel()
            with contextlib.suppress(asyncio.CancelledError, StoreUnavailable):
                await self._ping


STORE_CHECK = web.AppKey("idemproxy.admin.store_check", StoreCheck)


def _seen(ping: asyncio.Task[bool]) -> None:
    """A ping that failed after its probe answered: its error is the answer already given."""
    if not ping.cancelled():
        ping.exception()


async def _peers_session(app: web.Application) -> AsyncIterator[None]:
    peers = app[PEERS]
    await peers.open()
    yield
    await peers.close()


def _all_workers_metrics(metrics: Metrics) -> Handler:
    """`/metrics` for every worker, each series labelled with its worker (admin/peers.py)."""

    async def serve_metrics(request: web.Request) -> web.Response:
        own = generate_latest(metrics.registry).decode()
        others = await request.app[PEERS].metrics_texts()
        response = web.Response(body=merge_metrics([own, *others]))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return serve_metrics
