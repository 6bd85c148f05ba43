"""Fixtures of the fidelity suite: the store a module's proxies keep jobs in (SQLite, then
PostgreSQL), a log folder, the tools that come from outside PyPI, and a fresh key per test.

Servers and proxies are started once per module and store (each costs an interpreter start);
every test uses keys of its own, so tests never see each other's jobs or executions.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.fidelity.servers import ROOT
from tests.support.prerequisites import missing

NODE_PROJECT = ROOT / "tests" / "fidelity" / "node"  # package.json: json-server, pinned


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a module's servers and proxies write what they print (and their state)."""
    return tmp_path_factory.mktemp("fidelity")


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def proxy_store(request: pytest.FixtureRequest, logs: Path) -> Iterator[str]:
    """The proxy's store DSN: a new SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{logs}/idemproxy-{secrets.token_hex(3)}.db"
        return
    server: str = request.getfixturevalue("pg_server_dsn")
    clones = request.getfixturevalue("pg_clones")
    name = clones.take()
    try:
        yield urlsplit(server)._replace(path=f"/{name}").geturl()
    finally:
        clones.give_back(name)


@pytest.fixture
def key(proxy_store: str) -> str:
    """An Idempotency-Key nobody used, on any store, in any run."""
    return f"fid-{urlsplit(proxy_store).scheme}-{secrets.token_hex(6)}"


@pytest.fixture(scope="module")
def nginx_binary() -> str:
    """nginx from the distribution (.ci/run installs Debian's `nginx-light`)."""
    for where in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if where and os.access(where, os.X_OK):
            return where
    missing("no `nginx` on PATH or in /usr/sbin: apt-get install nginx-light")


@pytest.fixture(scope="module")
def json_server_binary() -> str:
    """json-server at the version tests/fidelity/node/package-lock.json pins (scripts/install
    installs it there when npm exists)."""
    binary = NODE_PROJECT / "node_modules" / ".bin" / "json-server"
    if shutil.which("node") is None:
        missing("no `node` on PATH for json-server: install Node.js and npm, then scripts/install")
    if not binary.exists():
        where = NODE_PROJECT.relative_to(ROOT)
        missing(f"json-server is not installed in {where}: run scripts/install (needs npm)")
    return str(binary)
