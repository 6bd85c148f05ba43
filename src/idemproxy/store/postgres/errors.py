"""The one place where asyncpg's errors become `StoreUnavailable`, so no driver error reaches the
proxy."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import asyncpg

from idemproxy.errors import ConfigError, StoreRefused, StoreUnavailable
from idemproxy.store.reach import postgres_address, postgres_unreachable

log = logging.getLogger("idemproxy.store")

DRIVER_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    # A pooled connection that the server ended, used before the driver noticed.
    asyncpg.InternalClientError,
)


# SQLSTATE classes 22 (data exception), 23 (integrity constraint) and 54 (program limit, e.g. a
# value too large): the statement's own data was refused. The same statement fails the same way.
REFUSED_ERRORS = (
    asyncpg.DataError,
    asyncpg.IntegrityConstraintViolationError,
    asyncpg.ProgramLimitExceededError,
)


def unavailable(what: str, exc: BaseException) -> StoreUnavailable:
    """What one of DRIVER_ERRORS becomes; raise it `from exc`."""
    # SPEC §11: fail closed. The detail never carries SQL or driver text to the client.
    log.warning("store error during %s: %s: %s", what, type(exc).__name__, exc)
    return StoreRefused() if isinstance(exc, REFUSED_ERRORS) else StoreUnavailable()


@contextlib.asynccontextmanager
async def translate_errors(what: str) -> AsyncIterator[None]:
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise unavailable(what, exc) from exc


@contextlib.asynccontextmanager
async def translate_connect_errors(dsn: str) -> AsyncIterator[None]:
    """As `translate_errors("connect")`, but a DSN asyncpg cannot use is a configuration error
    and a server that cannot be reached is `StoreUnreachable` naming it: one line at start-up
    (cli.main), not an outage to retry nor a traceback. Neither message carries the DSN: it may
    hold a password."""
    try:
        yield
    except asyncpg.ClientConfigurationError as exc:  # e.g. an unknown sslmode
        raise ConfigError(f"store: {exc}") from exc
    except ValueError as exc:  # the DSN itself did not parse (a port that is not a number, …)
        raise ConfigError(
            "store: the PostgreSQL DSN cannot be parsed (check its hosts, ports and parameters)"
        ) from exc
    except _REFUSED_DSN as exc:
        # The server answered and said no to this DSN's role, password or database: waiting
        # (store_start.max_wait) changes none of that, and "cannot reach" would send the reader
        # to the network. Named as the setting at fault, at once.
        raise ConfigError(
            f"store: PostgreSQL at {postgres_address(dsn)} refused the connection: {exc}"
        ) from exc
    except DRIVER_ERRORS as exc:
        if _refused_tls(exc):
            raise ConfigError(
                f"store: PostgreSQL at {postgres_address(dsn)} does not take TLS, which the "
                "DSN's sslmode requires (require, verify-ca, verify-full): enable ssl on the "
                "server, or change sslmode"
            ) from exc
        raise postgres_unreachable(dsn, exc) from exc


def _refused_tls(exc: BaseException) -> bool:
    """The server answered the TLS request with `N` (no ssl configured): as a refused role, no
    wait changes it. asyncpg says so only in its message (a plain ConnectionError)."""
    return isinstance(exc, ConnectionError) and "rejected SSL upgrade" in str(exc)


# SQLSTATE 28000 (a role that does not exist, a pg_hba.conf rejection), 28P01, 3D000.
_REFUSED_DSN = (
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidPasswordError,
    asyncpg.InvalidCatalogNameError,
)
