"""Path-prefix (and optional host) routing to upstreams (SPEC §10)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from yarl import URL

from idemproxy import constants as c
from idemproxy.config.keys import WebhookSettings
from idemproxy.config.resolve import ResolveSettings
from idemproxy.config.settings import RouteSettings, Settings
from idemproxy.config.upstream import UpstreamHeaderSettings
from idemproxy.errors import PathInvalid
from idemproxy.http.headers import Edits, HeaderEdits, host_name
from idemproxy.identity.key_source import KeySource
from idemproxy.identity.webhooks import WebhookVerifier
from idemproxy.proxy.readings import changeable, readings
from idemproxy.proxy.upstream.contract import Contract, ContractGate


@functools.lru_cache(maxsize=256)
def upstream_origin(upstream: str) -> str:
    """`scheme://host:port` of a configured upstream URL: the `upstream` log field and metric
    label, bounded by the configuration and without its path or credentials (SPEC §13)."""
    return str(URL(upstream).origin())


@dataclass(frozen=True, slots=True)
class Route:
    prefix: str
    host: str | None
    upstream: str  # the primary
    require_key: bool
    ttl: float
    fallbacks: tuple[str, ...] = ()
    hedge_after: float | None = None
    # Mutable eligibility of the fallbacks, when the group has a contract (SPEC §3.4).
    gate: ContractGate | None = field(default=None, compare=False, hash=False)
    # The route's own `upstream_timeout`; None: the global one (the upstream client's).
    upstream_timeout: float | None = None
    # How long a duplicate waits for the attempt in flight (SPEC §2.3): max_wait, or by default
    # as long as an attempt of this route may take, plus a margin.
    max_wait: float = c.DEFAULT_UPSTREAM_TIMEOUT + c.MAX_WAIT_MARGIN_SECONDS
    # Header edits per upstream of the group that has any (`upstream_headers`).
    header_edits: Mapping[str, Edits] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, hash=False, repr=False
    )
    # SPEC §4.1: where the key comes from; None is `key_header`, the fast path.
    key_source: KeySource | None = None
    # SPEC §4.2: a webhook route's signature check and owner; implies a `key_source`.
    webhook: WebhookVerifier | None = field(default=None, compare=False, hash=False, repr=False)
    # SPEC §10: the Host its upstreams receive (http/headers.py, `outgoing`).
    forward_host: str = c.DEFAULT_FORWARD_HOST
    # SPEC §3.6: how this route's `unknown` jobs may resolve themselves: a retry does what the
    # route it takes declares, never what another route of its path does.
    resolve: ResolveSettings = field(default_factory=ResolveSettings, compare=False, hash=False)

    @property
    def upstreams(self) -> tuple[str, ...]:
        """The primary, then the fallbacks that may take over, in order."""
        fallbacks = self.fallbacks if self.gate is None else self.gate.eligible
        return (self.upstream, *fallbacks)

    def matches(self, path: str, host: str | None) -> bool:
        """`host` is a `host_name` already (RouteTable.find): normalised once per request."""
        if self.host is not None and host != host_name(self.host):
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
        # Every route takes every path of its host: no reading of a path can change its route.
        self._by_prefix = any(route.prefix != "/" for route in routes)

    @classmethod
    def from_settings(cls, settings: Settings) -> RouteTable:
        return cls([_route(r, settings) for r in settings.all_routes])

    @property
    def routes(self) -> tuple[Route, ...]:
        return tuple(self._routes)

    def find(self, path: str, host: str | None) -> Route | None:
        name = None if host is None else host_name(host)
        for route in self._routes:
            # `Route.matches`, in place: it runs for every route tried on every request.
            if route.host is not None and name != host_name(route.host):
                continue
            prefix = route.prefix
            if prefix in ("/", path) or path.startswith(prefix.rstrip("/") + "/"):
                return route
        return None

    def resolve(self, path: str, host: str | None, url: URL | None = None) -> Route | None:
        """The route of a decoded path (aiohttp's `request.path`); `PathInvalid` when a backend
        may read the path as one under another route (proxy/readings.py). `url` is the target
        as sent (`request.rel_url`): its raw path is read with `%2F` kept in its segment as well,
        and only for a path some reading may change (the URL, not its path, is passed in).

        The target itself is forwarded byte for byte (SPEC §10): `/x/../payments` is refused
        where `/payments` is another route than `/x`'s (with `require_key: true`, it escaped
        into the `/` route and passed untracked), and forwarded untouched where it is not
        (one route, or `/payments/x/../y`)."""
        route = self.find(path, host)
        if self._by_prefix and changeable(path):
            for reading in readings(path, None if url is None else url.raw_path):
                if self.find(reading, host) is not route:
                    raise PathInvalid()
        return route


def _route(route: RouteSettings, settings: Settings) -> Route:
    edits = header_edits(route, settings)
    timeout = route.upstream_timeout
    return Route(
        prefix=route.prefix,
        host=route.host,
        upstream=route.upstream,
        require_key=settings.require_key if route.require_key is None else route.require_key,
        ttl=settings.ttl if route.ttl is None else route.ttl,
        fallbacks=tuple(route.fallbacks),
        hedge_after=route.hedge_after,
        gate=None
        if route.contract is None
        else ContractGate(
            Contract(route.contract), tuple(route.fallbacks), edits=edits, upstream_timeout=timeout
        ),
        upstream_timeout=timeout,
        max_wait=settings.effective_max_wait
        if timeout is None or settings.max_wait is not None
        else timeout + c.MAX_WAIT_MARGIN_SECONDS,
        header_edits=edits,
        key_source=_key_source(route, settings.key_header),
        webhook=None if route.webhook is None else _verifier(route.webhook),
        forward_host=route.forward_host,
        resolve=route.resolve,
    )


def _key_source(route: RouteSettings, key_header: str) -> KeySource | None:
    """SPEC §4.1, §4.2: `prefix` alone keeps the route's own source: the scheme's event id on a
    webhook route (whose senders send no `key_header`), `key_header` elsewhere."""
    source = route.key
    default = None if route.webhook is None else route.webhook.default_key_source
    if source is None:
        source = default
    if source is None:
        return None
    header, pointer = source.header, source.pointer
    if header is None and pointer is None:
        header, pointer = (
            (key_header, None) if default is None else (default.header, default.pointer)
        )
    return KeySource.of(header, pointer, source.prefix)


def _verifier(webhook: WebhookSettings) -> WebhookVerifier:
    return WebhookVerifier(webhook.scheme, webhook.sender, webhook.keys, webhook.tolerance)


def header_edits(route: RouteSettings, settings: Settings) -> Mapping[str, Edits]:
    """The route's `upstream_headers`, then each upstream's own, for the upstreams with any."""
    edits: dict[str, Edits] = {}
    for url in (route.upstream, *route.fallbacks):
        upstream = settings.upstreams.get(url)
        steps = [route.upstream_headers, *(() if upstream is None else (upstream.headers,))]
        found = tuple(_edit(step) for step in steps if step.set or step.remove)
        if found:
            edits[url] = found
    return MappingProxyType(edits)


def _edit(headers: UpstreamHeaderSettings) -> HeaderEdits:
    return HeaderEdits(tuple(headers.remove), headers.values)
