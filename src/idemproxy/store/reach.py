"""The one line a person reads when a store cannot be opened at start-up (`serve`, `migrate`,
`jobs …`): which server or file, and why. Never the DSN itself: it may hold a password."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import unquote, urlsplit

from idemproxy.errors import StoreUnreachable

_DEFAULT_PORT = 5432


def postgres_address(dsn: str) -> str:
    """`host:port/database` of a PostgreSQL DSN, as libpq would pick them by default."""
    parts = urlsplit(dsn)
    user, _, hosts = parts.netloc.rpartition("@")
    hosts = hosts or "localhost"
    if "," not in hosts and not hosts.rpartition(":")[2].isdigit():
        hosts = f"{hosts}:{_DEFAULT_PORT}"  # libpq's default port
    # libpq's default database is the user's name.
    database = unquote(parts.path.lstrip("/")) or unquote(user.partition(":")[0])
    return f"{hosts}/{database}"


def postgres_unreachable(dsn: str, exc: BaseException) -> StoreUnreachable:
    return StoreUnreachable(f"cannot reach PostgreSQL at {postgres_address(dsn)}: {cause(exc)}")


def sqlite_unopenable(path: str, why: str) -> StoreUnreachable:
    return StoreUnreachable(f"cannot open the SQLite store {Path(path).resolve()}: {why}")


def cause(exc: BaseException) -> str:
    """The reason, as a person says it: `connection refused`, `host not found`, or the server's
    own message (`database "x" does not exist`)."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"host not found ({exc.strerror})" if exc.strerror else "host not found"
    if isinstance(exc, TimeoutError):
        return "no answer in time (timed out)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__
