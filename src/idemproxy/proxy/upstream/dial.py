"""How the upstream client opens a connection to an origin: directly or through an egress proxy
(an HTTP CONNECT tunnel), in the clear or with TLS (SPEC §10).

Every failure here happens before a byte of a request was written, so it is a connect failure
(SPEC §3.2): the attempt is released and the next upstream may take over. That holds for a
tunnel the proxy refused (a 403, a 407) and for a TLS handshake that failed, whether on a
certificate the proxy does not trust or one the upstream does not accept.

Both kinds of upstream go through a tunnel, http ones too, rather than as absolute-form
requests to the proxy: only then is an answer from the proxy (its 502 or 503 when it cannot
reach the upstream) never mistaken for the upstream's own, which would settle a job on a status
the upstream never sent; and the request target still goes out byte for byte.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast
from urllib.parse import unquote, urlsplit

from idemproxy.config.upstream import NO_PROXY, UpstreamSettings, check_proxy_url, origin_of
from idemproxy.errors import ConfigError
from idemproxy.proxy.upstream.tls import tls_context
from idemproxy.redact import escaped, redact_url

Origin = tuple[str, int, bool]  # host, port, TLS
P = TypeVar("P", bound=asyncio.BaseProtocol)  # what speaks on a connection once it is open

if TYPE_CHECKING:
    from idemproxy.config.settings import Settings

log = logging.getLogger(__name__)
# A CONNECT answer's head larger than this is no proxy's.
_MAX_TUNNEL_HEAD = 16 * 1024


class TunnelRefused(ConnectionError):
    """The egress proxy did not open the tunnel: nothing reached the upstream."""


@dataclass(frozen=True, slots=True)
class EgressProxy:
    host: str
    port: int
    # `Basic …` from the proxy URL's user information; never logged.
    authorization: str | None = field(default=None, repr=False)

    @classmethod
    def from_url(cls, url: str) -> EgressProxy:
        parts = urlsplit(check_proxy_url(url))
        authorization = None
        if parts.username is not None:
            user_pass = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            authorization = "Basic " + base64.b64encode(user_pass.encode()).decode("ascii")
        return cls(parts.hostname or "", parts.port or 80, authorization)


@dataclass(frozen=True, slots=True)
class Dialer:
    """How connections to one origin are opened."""

    tls: ssl.SSLContext | None = None  # for an https origin
    server_name: str | None = None  # SNI and the name checked, instead of the host
    proxy: EgressProxy | None = None

    async def connect(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        protocol: Callable[[], P],
    ) -> P:
        """A connection to `host`:`port`, spoken by a new `protocol()`."""
        name = None if self.tls is None else self.server_name or host
        if self.proxy is None:
            _, connection = await loop.create_connection(
                protocol, host, port, ssl=self.tls, server_hostname=name
            )
            return connection
        return await _tunnel(loop, self.proxy, (host, port), protocol, self.tls, name)


_DIRECT = Dialer()


class Dialing:
    """The dialer of every origin, from the settings (read once, at start-up)."""

    def __init__(
        self,
        upstreams: Mapping[Origin, UpstreamSettings] | None = None,
        *,
        proxy: EgressProxy | None = None,
        environment: EnvironmentProxies | None = None,
    ) -> None:
        self._upstreams = dict(upstreams or {})
        self._proxy = proxy
        self._environment = environment
        self._dialers: dict[Origin, Dialer] = {}
        self._system_tls: ssl.SSLContext | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Dialing:
        """`ConfigError` for an unusable proxy in the environment or unusable TLS files."""
        cls.check(settings)
        upstreams = {origin_of(url): options for url, options in settings.upstreams.items()}
        for url, options in settings.upstreams.items():
            if not options.tls.verify:
                log.warning(
                    "upstream %s: TLS certificates are not verified (its tls.verify is false):"
                    " anyone on the path can read and change its traffic",
                    redact_url(url),
                )
        proxy = (
            None
            if settings.upstream_proxy is None
            else EgressProxy.from_url(settings.upstream_proxy)
        )
        environment = None
        if proxy is None and settings.upstream_proxy_from_env:
            environment = EnvironmentProxies.read(os.environ)
        return cls(upstreams, proxy=proxy, environment=environment)

    @staticmethod
    def check(settings: Settings) -> None:
        """`ConfigError` for an unusable proxy in the environment or TLS files that do not load
        (a bundle that is no PEM, a key that does not match its certificate), before anything
        is opened. The contexts built are the ones the upstream client then uses."""
        if settings.upstream_proxy is None and settings.upstream_proxy_from_env:
            EnvironmentProxies.read(os.environ)
        for url, options in settings.upstreams.items():
            try:
                tls_context(options.tls)
            except ValueError as exc:
                raise ConfigError(f"upstreams.{redact_url(url)}.tls: {exc}") from exc

    def dialer(self, origin: Origin) -> Dialer:
        found = self._dialers.get(origin)
        if found is None:
            found = self._dialers[origin] = self._dialer(origin)
        return found

    def _dialer(self, origin: Origin) -> Dialer:
        tls = origin[2]
        options = self._upstreams.get(origin)
        proxy = self._proxy_for(origin, options)
        if not tls:
            return _DIRECT if proxy is None else Dialer(proxy=proxy)
        if options is None:
            return Dialer(self._system_context(), None, proxy)
        return Dialer(tls_context(options.tls), options.tls.server_name, proxy)

    def _system_context(self) -> ssl.SSLContext:
        """For an https upstream with no settings of its own: the system's CAs (SSL_CERT_FILE
        when set), names checked; one per client."""
        if self._system_tls is None:
            self._system_tls = ssl.create_default_context()
        return self._system_tls

    def _proxy_for(self, origin: Origin, options: UpstreamSettings | None) -> EgressProxy | None:
        if options is not None and options.proxy is not None:
            return None if options.proxy == NO_PROXY else EgressProxy.from_url(options.proxy)
        if self._proxy is not None:
            return self._proxy
        if self._environment is not None:
            return self._environment.proxy_for(*origin)
        return None


@dataclass(frozen=True, slots=True)
class EnvironmentProxies:
    """HTTPS_PROXY, HTTP_PROXY, ALL_PROXY and NO_PROXY, as curl reads them (lower case first)."""

    https: EgressProxy | None
    http: EgressProxy | None
    no_proxy: tuple[str, ...]

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> EnvironmentProxies:
        every = _proxy_variable(environ, "all_proxy")
        no_proxy = _variable(environ, "no_proxy")
        return cls(
            https=_proxy_variable(environ, "https_proxy") or every,
            http=_proxy_variable(environ, "http_proxy") or every,
            no_proxy=()
            if no_proxy is None
            else tuple(entry.strip() for entry in no_proxy[1].split(",") if entry.strip()),
        )

    def proxy_for(self, host: str, port: int, tls: bool) -> EgressProxy | None:
        proxy = self.https if tls else self.http
        if proxy is None or bypasses(self.no_proxy, host, port):
            return None
        return proxy


def _variable(environ: Mapping[str, str], lower: str) -> tuple[str, str] | None:
    """The variable set, lower case first (`https_proxy`, then `HTTPS_PROXY`), and its value."""
    for name in (lower, lower.upper()):
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def _proxy_variable(environ: Mapping[str, str], lower: str) -> EgressProxy | None:
    found = _variable(environ, lower)
    if found is None:
        return None
    name, value = found
    url = value if "://" in value else f"http://{value}"  # curl: a bare host:port is http
    try:
        return EgressProxy.from_url(url)
    except ValueError as exc:
        raise ConfigError(f"{name} (upstream_proxy_from_env): {exc}") from exc


def bypasses(no_proxy: tuple[str, ...], host: str, port: int) -> bool:
    """Whether NO_PROXY exempts `host`:`port`, as curl reads it: `*` exempts every host; a name
    exempts itself and its subdomains (a leading `.` or `*.` changes nothing); an IP address or
    a CIDR range exempts the addresses in it; `:PORT` after an entry limits it to that port."""
    name = host.lower().removesuffix(".")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(name)
    except ValueError:
        address = None
    for entry in no_proxy:
        if entry == "*":
            return True
        pattern, entry_port = _split_port(entry)
        if entry_port is not None and entry_port != port:
            continue
        if address is not None:
            try:
                if address in ipaddress.ip_network(pattern, strict=False):
                    return True
            except ValueError:
                pass
            continue
        pattern = pattern.lower().removeprefix("*").removeprefix(".").removesuffix(".")
        if pattern and (name == pattern or name.endswith("." + pattern)):
            return True
    return False


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6]:port or [v6]
        inside, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":")
        return inside, int(port) if port.isdigit() else None
    if entry.count(":") == 1:  # name:port or v4:port; a bare IPv6 address has more colons
        pattern, _, port = entry.partition(":")
        return pattern, int(port) if port.isdigit() else None
    return entry, None


class _TunnelOpening(asyncio.Protocol):
    """The proxy's answer to CONNECT, read before the connection is the upstream's."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.answer: asyncio.Future[bytes] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self._received = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.answer.done():
            return
        self._received += data
        end = self._received.find(b"\r\n\r\n")
        if end >= 0:
            if end + 4 != len(self._received):
                # The upstream speaks second (TLS: the client's hello; HTTP: the request).
                self.answer.set_exception(TunnelRefused("egress proxy sent bytes after CONNECT"))
            else:
                self.answer.set_result(self._received)
        elif len(self._received) > _MAX_TUNNEL_HEAD:
            self.answer.set_exception(TunnelRefused("egress proxy's CONNECT answer too large"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answer.done():
            self.answer.set_exception(TunnelRefused("egress proxy closed the connection"))


async def _tunnel(
    loop: asyncio.AbstractEventLoop,
    proxy: EgressProxy,
    address: tuple[str, int],
    protocol: Callable[[], P],
    tls: ssl.SSLContext | None,
    server_name: str | None,
) -> P:
    """A connection to `address` through a CONNECT tunnel (RFC 9110 §9.3.6), TLS inside."""
    host, port = address
    transport, opening = await loop.create_connection(
        lambda: _TunnelOpening(loop), proxy.host, proxy.port
    )
    try:
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        request = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
        if proxy.authorization is not None:
            request += f"Proxy-Authorization: {proxy.authorization}\r\n"
        transport.write(f"{request}\r\n".encode("latin-1"))
        _check_tunnel(await opening.answer, proxy, authority)
        connection = protocol()
        if tls is None:
            transport.set_protocol(connection)
            connection.connection_made(transport)
            return connection
        tls_transport = await loop.start_tls(
            transport, connection, tls, server_hostname=server_name
        )
        if tls_transport is None:  # pragma: no cover - only with a closed transport
            raise TunnelRefused("the tunnel closed during the TLS handshake")
        connection.connection_made(tls_transport)
        return connection
    except BaseException:
        transport.abort()
        raise


def _check_tunnel(head: bytes, proxy: EgressProxy, authority: str) -> None:
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    version, _, rest = status_line.partition(" ")
    status = rest[:3]
    if not version.startswith("HTTP/1.") or not status.isdigit():
        raise TunnelRefused(f"egress proxy {proxy.host}:{proxy.port} answered no HTTP status")
    if not 200 <= int(status) < 300:
        raise TunnelRefused(
            f"egress proxy {proxy.host}:{proxy.port} refused CONNECT {authority}:"
            f" {escaped(rest.strip())}"
        )
