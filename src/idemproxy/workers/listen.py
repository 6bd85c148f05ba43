"""One group of workers per listen address (`server.workers` > 1, workers/supervisor.py).

Workers bind `listen` with SO_REUSEPORT, and the kernel lets any process of the same user join
such a port: a second `--workers` group started on a port the first one serves (with another
store, say) would silently take half its connections, and one key would execute once per
group. A single process binds without SO_REUSEPORT and is refused a taken port; a supervisor
now is too, before it migrates or starts anything:

* a probe bind without SO_REUSEPORT fails while anything listens there (a single process, or
  the workers of a group already serving);
* a lock held for the supervisor's life covers the time its workers take to start and bind,
  when the probe alone would let a second group in: a Unix socket bound in the abstract
  namespace (Linux), named by the address, released by the kernel however the process ends.
"""

from __future__ import annotations

import socket
import sys

from idemproxy.config.settings import parse_listen
from idemproxy.errors import ListenFailed

_LOCK_PREFIX = "\0idemproxy-workers-listen:"


def claim_listen(listen: str) -> socket.socket | None:
    """The address's lock (None where there are none), or ListenFailed naming it."""
    host, port = parse_listen(listen)
    lock = _lock(host, port)
    try:
        probe(host, port)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    return lock


def probe(host: str, port: int) -> None:
    """Bind every address of `host:port` as a single process would (no SO_REUSEPORT)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ListenFailed(f"listen: cannot resolve {host}: {exc}") from exc
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as sock:
            # As the workers do: a port with connections in TIME_WAIT is not taken.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise ListenFailed(
                    f"listen: cannot listen on {host}:{port}: {exc.strerror or exc}"
                ) from exc


def _lock(host: str, port: int) -> socket.socket | None:
    if not sys.platform.startswith("linux"):
        return None  # no abstract namespace: the probe alone
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"{_LOCK_PREFIX}{host}:{port}")
    except OSError as exc:
        sock.close()
        raise ListenFailed(
            f"listen: {host}:{port} is already in use by another idemproxy --workers group"
            f" (starting or serving; {exc.strerror})"
        ) from exc
    return sock
