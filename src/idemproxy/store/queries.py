"""Loading named SQL sections and migrations from the package's `sql/` folder: the SQL lives in .sql
files, not in Python strings."""

from __future__ import annotations

import functools
import re
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@functools.cache
def load_queries(dialect: str) -> dict[str, str]:
    """`{name: sql}` from `sql/<dialect>/queries.sql`."""
    text = resources.files("idemproxy.store").joinpath("sql", dialect, "queries.sql").read_text()
    parts = _NAME.split(text)
    return {
        name: body.strip().rstrip(";") for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def load_migrations(dialect: str) -> list[tuple[str, str]]:
    """`[(version, sql)]` sorted by version, from `sql/<dialect>/migrations/NNNN_name.sql`."""
    folder = resources.files("idemproxy.store").joinpath("sql", dialect, "migrations")
    files = sorted(
        (entry for entry in folder.iterdir() if entry.name.endswith(".sql")),
        key=lambda entry: entry.name,
    )
    return [(entry.name.removesuffix(".sql"), entry.read_text()) for entry in files]
