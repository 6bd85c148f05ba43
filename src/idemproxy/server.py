"""Running the proxy as a process: event loop, logging, listener and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import sys

from aiohttp import web

from idemproxy.config import Settings, parse_listen
from idemproxy.logs import configure_logging
from idemproxy.proxy.app import create_app

log = logging.getLogger("idemproxy")


def serve(settings: Settings) -> None:
    configure_logging(settings.log_level, settings.log_format)
    host, port = parse_listen(settings.listen)
    loop = _new_loop()
    log.info("idemproxy listening on %s:%d, store %s", host, port, _redacted(settings.store))
    web.run_app(
        create_app(settings),
        host=host,
        port=port,
        loop=loop,
        access_log=None,  # one log line per request costs more than the proxy itself
        shutdown_timeout=settings.server.shutdown_timeout,
        keepalive_timeout=settings.server.keepalive_timeout,
        handler_cancellation=False,  # SPEC §2: a client hanging up cancels nothing
        print=None,
    )


def _new_loop() -> asyncio.AbstractEventLoop:
    if sys.platform != "win32":
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
            pass
    return asyncio.new_event_loop()


def _redacted(dsn: str) -> str:
    """A DSN without its password, for logs."""
    scheme, sep, rest = dsn.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return dsn
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{hostpart}"
