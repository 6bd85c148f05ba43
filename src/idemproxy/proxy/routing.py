"""Path-prefix (and optional host) routing to upstreams (SPEC §10)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from idemproxy.config import ContractSettings, RouteSettings, Settings
from idemproxy.errors import PathInvalid
from idemproxy.proxy.contract import Contract, ContractGate

# A `.` or `..` segment, or an empty one, in the percent-decoded path; `\\` counts as a separator
# because some servers (IIS, and frameworks on Windows) take it for one.
_AMBIGUOUS = re.compile(r"[/\\](?:\.{1,2}(?=[/\\]|$)|(?=[/\\]))")


def routable_path(path: str) -> str:
    """The decoded path (aiohttp's `request.path`) to route on; `PathInvalid` when it is ambiguous.

    RFC 3986 §5.2.4: a backend removes dot segments (`/x/../payments` is `/payments`), many merge
    repeated slashes, and many decode `%2e` and `%2f` before they do. Matched as sent, such a
    target escaped a `/payments` route with `require_key: true` into the `/` route. No API client
    needs one, so rather than guess how each backend resolves it, the proxy refuses it (400).
    """
    if _AMBIGUOUS.search(path):
        raise PathInvalid()
    return path


@dataclass(frozen=True, slots=True)
class Route:
    prefix: str
    host: str | None
    upstream: str  # the primary
    require_key: bool
    ttl: float
    fallbacks: tuple[str, ...] = ()
    hedge_after: float | None = None
    contract: ContractSettings | None = None
    # Mutable eligibility of the fallbacks, when the group has a contract (SPEC §3.4).
    gate: ContractGate | None = field(default=None, compare=False, hash=False)

    @property
    def upstreams(self) -> tuple[str, ...]:
        """The primary, then the fallbacks that may take over, in order."""
        fallbacks = self.fallbacks if self.gate is None else self.gate.eligible
        return (self.upstream, *fallbacks)

    def matches(self, path: str, host: str | None) -> bool:
        if self.host is not None and (host or "").split(":")[0].lower() != self.host.lower():
            return False
        if self.prefix in ("/", path):
            return True
        return path.startswith(self.prefix.rstrip("/") + "/")


class RouteTable:
    """Longest prefix wins; routes with a host beat those without at equal length."""

    def __init__(self, routes: list[Route]) -> None:
        self._routes = sorted(
            routes, key=lambda r: (len(r.prefix), r.host is not None), reverse=True
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> RouteTable:
        return cls([_route(r, settings) for r in settings.all_routes])

    @property
    def routes(self) -> tuple[Route, ...]:
        return tuple(self._routes)

    def find(self, path: str, host: str | None) -> Route | None:
        for route in self._routes:
            if route.matches(path, host):
                return route
        return None


def _route(route: RouteSettings, settings: Settings) -> Route:
    return Route(
        prefix=route.prefix,
        host=route.host,
        upstream=route.upstream,
        require_key=settings.require_key if route.require_key is None else route.require_key,
        ttl=settings.ttl if route.ttl is None else route.ttl,
        fallbacks=tuple(route.fallbacks),
        hedge_after=route.hedge_after,
        contract=route.contract,
        gate=None
        if route.contract is None
        else ContractGate(Contract(route.contract), tuple(route.fallbacks)),
    )
