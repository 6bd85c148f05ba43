"""One `--workers` group per listen address (workers/listen.py), on real loopback sockets."""

from __future__ import annotations

import socket
import sys

import pytest

from idemproxy.errors import ListenFailed
from idemproxy.workers.listen import claim_listen


@pytest.fixture
def port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free: int = sock.getsockname()[1]
    return free


def test_a_port_a_group_serves_is_refused(port: int) -> None:
    """A worker's socket (SO_REUSEPORT) would let another group's workers join; the probe
    binds without it, as a single process does."""
    with socket.socket() as worker:
        worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        worker.bind(("127.0.0.1", port))
        worker.listen()
        with pytest.raises(ListenFailed, match=f"listen: cannot listen on 127.0.0.1:{port}"):
            claim_listen(f"127.0.0.1:{port}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets: Linux")
def test_a_group_still_starting_holds_its_address(port: int) -> None:
    """Between the probe and its workers' binds, the first group's lock refuses a second."""
    lock = claim_listen(f"127.0.0.1:{port}")
    assert lock is not None
    with pytest.raises(ListenFailed, match="in use by another idemproxy --workers group"):
        claim_listen(f"127.0.0.1:{port}")
    lock.close()  # released with the supervisor (or when it starts stopping)
    again = claim_listen(f"127.0.0.1:{port}")
    assert again is not None
    again.close()
