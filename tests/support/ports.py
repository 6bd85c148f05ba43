"""Loopback ports for the servers and processes the tests start.

A port is chosen before the server that listens on it starts, and several pytest processes
choose at once (the xdist workers of `scripts/test`, other test runs on the same machine), so a
port that is merely free now may be handed to two of them. Each port handed out is therefore
claimed machine-wide for the life of the process that chose it: a lock on the port's byte of one
lock file (an fcntl record lock, which the kernel drops when the process exits, however it
exits). Ports come from below the kernel's ephemeral range, where the local end of an outgoing
connection (a client of the shared PostgreSQL, say) cannot land between the choice and the bind.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import random
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

_LOCK_FILE = Path(tempfile.gettempdir()) / f"idemproxy-test-ports-{os.getuid()}.lock"
_LOWEST = 10000  # below: well-known and registered services
_MIN_SPAN = 1000  # fewer ports than that below the ephemeral range: take the kernel's choice
_TRIES = 65536


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _candidates() -> Iterator[int]:
    """Every port below the ephemeral range once per round, from a random start (two processes
    rarely probe the same port at the same moment), or the kernel's free ports."""
    high = _ephemeral_low() - 1
    if high - _LOWEST < _MIN_SPAN:
        while True:
            yield _kernel_choice()
    start = random.randint(_LOWEST, high)
    yield from itertools.cycle([*range(start, high + 1), *range(_LOWEST, start)])


def _kernel_choice() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _bindable(port: int) -> bool:
    """Nobody listens on the port, nor holds a connection from it (no SO_REUSEADDR: a port
    with connections lingering in TIME_WAIT is skipped too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class _Claims:
    def __init__(self) -> None:
        self._fd: int | None = None  # opened once, never closed: closing drops every lock
        self._ports = _candidates()
        self._given: set[int] = set()

    def claim(self, port: int) -> bool:
        if self._fd is None:
            self._fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
        except OSError:  # another process holds it
            return False
        return True

    def next_port(self) -> int:
        for port in itertools.islice(self._ports, _TRIES):
            # Locks are per process: this process's own claims must be skipped by hand.
            if port not in self._given and _bindable(port) and self.claim(port):
                self._given.add(port)
                return port
        raise OSError(f"no free loopback port in {_TRIES} tries")


_claims = _Claims()


def free_port() -> int:
    """A loopback port nobody listens on, handed to no other test process on this machine."""
    return _claims.next_port()
