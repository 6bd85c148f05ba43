"""Which reconcile endpoint may be asked about an `unknown` job's attempt (SPEC §3.6).

* A retry asks the endpoint of the route it took itself (`Endpoint.of_route`).
* The background, which has only the job, matches it to routes the way its request was routed
  (SPEC §10, proxy/routing.py `RouteTable.find`): longest prefix first, over every route,
  whether it declares `resolve` or not. The job does not record the Host it came with, so each
  host a route names (and any other) is tried: where the job's path may have taken routes
  that do not all name the same endpoint, no endpoint answers for it (`Endpoints.for_job`).
* Either way an endpoint answers only for attempts on an upstream of its route with its own
  origin (`Endpoint.vouches_for`): another origin, a fallback elsewhere, never saw the attempt
  and would truthfully say it never executed there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from urllib.parse import unquote

from idemproxy.config.resolve import ReconcileSettings
from idemproxy.config.settings import Settings
from idemproxy.http.headers import Edits, host_name
from idemproxy.proxy.routing import Route, header_edits, upstream_origin


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A route's reconcile endpoint: `upstreams`, those of the route's group it vouches for;
    `edits`, their `upstream_headers` (the route's, then the upstream's), which a question
    about an attempt on one of them carries (SPEC §10). Two routes' endpoints are equal when
    they would ask the same question the same way, whatever their prefixes."""

    prefix: str = field(compare=False)
    upstreams: frozenset[str]
    reconcile: ReconcileSettings
    ttl: float
    edits: Mapping[str, Edits]

    @classmethod
    def of(
        cls,
        prefix: str,
        group: Iterable[str],
        reconcile: ReconcileSettings,
        ttl: float,
        edits: Mapping[str, Edits],
    ) -> Endpoint:
        """SPEC §3.6: the endpoint vouches for the upstreams of `group` with its origin, and
        only their header edits go to it: another origin's credential stays with its origin."""
        origin = upstream_origin(reconcile.url)
        vouched = frozenset(url for url in group if upstream_origin(url) == origin)
        kept = MappingProxyType({url: edits[url] for url in sorted(vouched) if url in edits})
        return cls(prefix, vouched, reconcile, ttl, kept)

    @classmethod
    def of_route(cls, route: Route) -> Endpoint | None:
        """The endpoint of the route a retry took; None when it names none."""
        reconcile = route.resolve.reconcile
        if reconcile is None:
            return None
        group = (route.upstream, *route.fallbacks)
        return cls.of(route.prefix, group, reconcile, route.ttl, route.header_edits)

    def vouches_for(self, upstream: str) -> bool:
        return upstream in self.upstreams


@dataclass(frozen=True, slots=True)
class _Routed:
    """A route as the background matches a job to it: where it takes requests, where it sends
    them, and its endpoint (None: it declares none)."""

    prefix: str
    host: str | None  # a `host_name` already
    group: frozenset[str]
    endpoint: Endpoint | None

    def matches(self, path: str, host: str | None) -> bool:
        """As proxy/routing.py `Route.matches`."""
        if self.host is not None and host != self.host:
            return False
        return self.prefix in ("/", path) or path.startswith(self.prefix.rstrip("/") + "/")


class Endpoints:
    """Every route of the process, in the order routing tries them, with its endpoint."""

    def __init__(self, routes: Sequence[_Routed]) -> None:
        # SPEC §10: longest prefix first; with a host before without at equal length. Of two
        # routes with one prefix and host, routing only ever takes the first.
        unique: dict[tuple[str, str | None], _Routed] = {}
        for route in routes:
            unique.setdefault((route.prefix, route.host), route)
        self._routes = sorted(
            unique.values(), key=lambda r: (len(r.prefix), r.host is not None), reverse=True
        )
        self._hosts = (None, *sorted({r.host for r in self._routes if r.host is not None}))
        declared = (r.endpoint for r in self._routes if r.endpoint is not None)
        self.declared: tuple[Endpoint, ...] = tuple(declared)

    def __bool__(self) -> bool:
        return bool(self.declared)

    def may_cover(self, path: str) -> bool:
        """Whether some route `path` may have taken names an endpoint (cheap: no attempt read;
        `for_job` decides)."""
        return any(r.endpoint is not None for r in self._taken(path))

    def for_job(self, path: str, upstream: str) -> Endpoint | None:
        """The endpoint of the route a job on `path` whose attempt went to `upstream` took, when
        that can be told: every route the path may have taken for some host, and sent there,
        names the same endpoint. None otherwise (the job stays `unknown`: a retry, which has its
        route, or an operator resolves it)."""
        taken = [r.endpoint for r in self._taken(path) if upstream in r.group]
        if not taken or any(endpoint != taken[0] for endpoint in taken):
            return None
        return taken[0]

    def _taken(self, path: str) -> list[_Routed]:
        """The routes `path` may have taken: one for each host a route names, and for any other
        (None)."""
        decoded = unquote(path.partition("?")[0])
        taken: list[_Routed] = []
        for host in self._hosts:
            route = next((r for r in self._routes if r.matches(decoded, host)), None)
            if route is not None and all(route is not other for other in taken):
                taken.append(route)
        return taken


def endpoints(settings: Settings) -> Endpoints:
    """Every configured route (`--upstream`'s catch-all last), with its endpoint if it names
    one."""
    routes = []
    for route in settings.all_routes:
        group = (route.upstream, *route.fallbacks)
        ttl = settings.ttl if route.ttl is None else route.ttl
        reconcile = route.resolve.reconcile
        endpoint = None
        if reconcile is not None:
            endpoint = Endpoint.of(
                route.prefix, group, reconcile, ttl, header_edits(route, settings)
            )
        host = None if route.host is None else host_name(route.host)
        routes.append(_Routed(route.prefix, host, frozenset(group), endpoint))
    return Endpoints(routes)
