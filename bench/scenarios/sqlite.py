"""idemproxy on SQLite (a file in the run's directory): new keys."""

from __future__ import annotations

from common import running
from model import Scenario
from runner import Bench, Step

NEW_SQLITE = Scenario(
    "new-sqlite", "proxy new keys, SQLite", "proxy-sqlite", "unique_key.lua", "sqlite"
)


def run(bench: Bench) -> None:
    with running(bench.start_proxy("proxy-sqlite", f"sqlite:///{bench.sqlite_path}")):
        bench.measure(NEW_SQLITE)


STEP = Step("proxy-sqlite", (NEW_SQLITE,), run)
