"""The admin application, on a listener of its own (SPEC §13)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from idemproxy.admin.jobs import add_jobs_routes, client_max_size
from idemproxy.config import Settings
from idemproxy.errors import StoreUnavailable, Unauthorized
from idemproxy.metrics import Metrics, metrics_handler
from idemproxy.proxy.problems import problem_response
from idemproxy.store.base import Store


@dataclass(slots=True)
class Readiness:
    """Ready once started, not ready while draining (so load balancers stop sending)."""

    draining: bool = False
    reasons: list[str] = field(default_factory=list)


STORE = web.AppKey("idemproxy.admin.store", Store)
READINESS = web.AppKey("idemproxy.admin.readiness", Readiness)
# Probes and scrapers cannot easily send a secret header; none of these reveal a job or a
# response. The jobs API always needs the token when one is configured.
_OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def create_admin_app(
    settings: Settings, store: Store, readiness: Readiness, *, metrics: Metrics | None = None
) -> web.Application:
    token = settings.admin.token.get_secret_value() if settings.admin.token else None
    app = web.Application(
        middlewares=[_bearer_auth(token)] if token else [],
        client_max_size=client_max_size(settings),
    )
    app[STORE] = store
    app[READINESS] = readiness
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    if metrics is not None:
        app.router.add_get("/metrics", metrics_handler(metrics))
    add_jobs_routes(app, settings, store)  # SPEC §3.3: behind the token, like every other path
    return app


def _bearer_auth(token: str) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in _OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # constant time: no token oracle
            response = problem_response(Unauthorized())
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    return bearer_auth


async def _healthz(_request: web.Request) -> web.Response:
    """Liveness: the process answers. Never depends on the store (no restart storms)."""
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    """Readiness: the store answers and the process is not draining."""
    if request.app[READINESS].draining:
        return web.json_response({"status": "draining"}, status=503)
    try:
        await request.app[STORE].ping()
    except StoreUnavailable:
        return web.json_response({"status": "store-unavailable"}, status=503)
    return web.json_response({"status": "ready"})
