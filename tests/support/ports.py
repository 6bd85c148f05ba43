"""Loopback ports for the servers and processes the tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nobody listens on right now (a race remains: callers that lose it retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
