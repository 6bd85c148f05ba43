"""A request's log line and metrics are made once its answer is written (proxy/handler.py).

The line costs the event loop time that the client need not wait for (docs/benchmarks.md, "The
request's line and metrics after its answer"). A handler on the request logger that holds the
event loop for a while shows the order: the client, reading from another thread, has the whole
answer long before the line's handler returns.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator

import pytest

from .conftest import ListeningProxy

HOLD_SECONDS = 1.0


class HoldingHandler(logging.Handler):
    """Holds whichever thread emits a request line (the event loop's) for HOLD_SECONDS."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.emitted: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.emitted.append(time.monotonic())
        time.sleep(HOLD_SECONDS)


@pytest.fixture
def holding() -> Iterator[HoldingHandler]:
    handler = HoldingHandler()
    requests = logging.getLogger("idemproxy.requests")
    level = requests.level
    requests.addHandler(handler)
    requests.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        requests.removeHandler(handler)
        requests.setLevel(level)


def answered_after(address: tuple[str, int], request: bytes) -> tuple[bytes, float]:
    """The whole answer (the proxy closes after it), and how long after sending it began."""
    with socket.create_connection(address, timeout=10) as client:
        sent = time.monotonic()
        client.sendall(request)
        first = client.recv(65536)
        took = time.monotonic() - sent
        rest = b""
        while chunk := client.recv(65536):
            rest += chunk
        return first + rest, took


@pytest.mark.parametrize("key", [None, "k-record"], ids=["pass-through", "new key"])
async def test_the_answer_is_written_before_the_line_is_made(
    listening_proxy: ListeningProxy, holding: HoldingHandler, key: str | None
) -> None:
    address = await listening_proxy(access_log=True)
    body = b'{"amount":1}'
    head = (
        f"POST /pay HTTP/1.1\r\nHost: proxy\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
    )
    if key is not None:
        head += f"Idempotency-Key: {key}\r\n"
    answer, took = await asyncio.to_thread(answered_after, address, head.encode() + b"\r\n" + body)
    assert answer.startswith(b"HTTP/1.1 201 "), answer
    assert holding.emitted, "no request line"
    assert took < HOLD_SECONDS / 2, f"the answer waited for its log line: {took:.3f} s"
