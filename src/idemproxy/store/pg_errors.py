"""The one place where asyncpg's errors become `StoreUnavailable` (STYLE §4)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import asyncpg

from idemproxy.errors import StoreRefused, StoreUnavailable

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
