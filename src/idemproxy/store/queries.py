"""Loading named SQL sections and migrations from the package's `sql/` folder: the SQL lives in .sql
files, not in Python strings."""

from __future__ import annotations

import functools
import re
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# The end of a statement in a migration: a semicolon that ends its line.
_STATEMENT_END = re.compile(r";[ \t]*$", re.MULTILINE)


@functools.cache
def load_queries(dialect: str) -> dict[str, str]:
    """`{name: sql}` from `sql/<dialect>/queries.sql`."""
    text = resources.files("idemproxy.store").joinpath("sql", dialect, "queries.sql").read_text()
    parts = _NAME.split(text)
    return {
        name: body.strip().rstrip(";") for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def statements(sql: str) -> list[str]:
    """The statements of a migration, each to be sent alone: Citus propagates index and
    constraint changes to the shards by a prepared statement, which refuses a string of several
    commands. A statement ends with a semicolon at the end of a line (never inside one)."""
    return [part.strip() for part in _STATEMENT_END.split(sql) if _code(part)]


def _code(part: str) -> bool:
    return any(line.strip() and not line.lstrip().startswith("--") for line in part.splitlines())


def load_migrations(dialect: str) -> list[tuple[str, str]]:
    """`[(version, sql)]` sorted by version, from `sql/<dialect>/migrations/NNNN_name.sql`."""
    folder = resources.files("idemproxy.store").joinpath("sql", dialect, "migrations")
    files = sorted(
        (entry for entry in folder.iterdir() if entry.name.endswith(".sql")),
        key=lambda entry: entry.name,
    )
    return [(entry.name.removesuffix(".sql"), entry.read_text()) for entry in files]
