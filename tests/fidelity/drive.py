"""Driving one request three ways: at the server directly, through the proxy, and again through
the proxy with the same key (the replay), then comparing the three answers and counting the
executions of the intent.

A server that creates things answers a second execution differently from the first (another
id, "already exists"), so the direct request goes to a twin: a second process of the same
server, started from the same state and sent the same requests in the same order, never
through the proxy. The twins stay in step as long as the proxy executes each intent once,
which is what the ledgers check.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.fidelity.compare import Volatile, assert_replay_of, assert_same_as_server
from tests.fidelity.servers import Running, serving
from tests.fidelity.wire import Answer, exchange

# An execution is recorded by the server itself, and a server may write its record just after
# it answered (nginx's access log is written in the request's last phase): a count lower than
# expected is read again for this long before it fails.
SETTLE = 2.0


@dataclass
class Ledger:
    """Executions a server recorded, one per line; `read` turns the file into the lines that
    name an intent (by default the line is the Idempotency-Key)."""

    path: Path
    read: Callable[[Path], list[str]] = lambda path: path.read_text().splitlines()

    def count(self, intent: str, *, expected: int = 1) -> int:
        until = time.monotonic() + SETTLE
        while True:
            found = self.read(self.path).count(intent) if self.path.exists() else 0
            if found >= expected or time.monotonic() > until:
                return found
            time.sleep(0.05)


@dataclass
class Twins:
    direct: Running  # driven directly
    behind: Running  # the proxy's upstream
    direct_ledger: Ledger
    behind_ledger: Ledger


@contextlib.contextmanager
def twins(
    name: str,
    command: Callable[[int, Path], Sequence[str]],
    logs: Path,
    ledger: Callable[[Path], Ledger] = Ledger,
    *,
    seed: str = "",
    suffix: str = ".ledger",
) -> Iterator[Twins]:
    """Two processes of `command(port, state)`, each with its own state file (`seed` at first;
    also in the environment as `LEDGER`), the first driven directly, the second behind the
    proxy."""
    paths = [logs / f"{name}-direct{suffix}", logs / f"{name}-behind{suffix}"]
    for path in paths:
        path.write_text(seed)

    def serve(path: Path, role: str) -> contextlib.AbstractContextManager[Running]:
        return serving(
            f"{name}-{role}", lambda port: command(port, path), logs, env={"LEDGER": str(path)}
        )

    with serve(paths[0], "direct") as direct, serve(paths[1], "behind") as behind:
        yield Twins(direct, behind, ledger(paths[0]), ledger(paths[1]))


@dataclass(frozen=True)
class Driven:
    direct: Answer
    first: Answer
    replay: Answer


def three_ways(
    direct_port: int,
    proxy_port: int,
    data: bytes,
    *,
    method: str,
    volatile: Sequence[Volatile] = (),
) -> Driven:
    """`data` to the server, to the proxy, and to the proxy again: the proxy's first answer is
    the server's (but for `volatile`), the second its replay."""
    direct = exchange(direct_port, data, method=method)
    first = exchange(proxy_port, data, method=method)
    assert_same_as_server(direct, first, volatile, governed=True)
    replay = exchange(proxy_port, data, method=method)
    assert_replay_of(first, replay)
    return Driven(direct, first, replay)


def passed_through(
    direct_port: int, proxy_port: int, data: bytes, *, method: str = "GET"
) -> Answer:
    """`data` (a request the proxy does not govern) to the server and through the proxy."""
    direct = exchange(direct_port, data, method=method)
    proxied = exchange(proxy_port, data, method=method)
    assert_same_as_server(direct, proxied, governed=False)
    return direct
