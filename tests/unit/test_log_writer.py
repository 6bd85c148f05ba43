"""The background log writer (idemproxy/logs.py): lines wait for a slow stderr up to a bound,
then are dropped and counted; nothing waits on the caller's thread."""

from __future__ import annotations

import io
import logging
import threading
import time

from idemproxy.logs import BackgroundWriter


class StalledStream(io.StringIO):
    """A stderr whose reader stopped: `write` blocks until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        assert self.release.wait(10), "never released"
        return super().write(text)


def _record(number: int) -> logging.LogRecord:
    return logging.LogRecord("t", logging.INFO, __file__, 1, f"line {number}", (), None)


def test_lines_beyond_the_backlog_are_dropped_and_counted_never_waited_for() -> None:
    stream = StalledStream()
    writer = BackgroundWriter(stream, backlog=3)
    try:
        writer.emit(_record(0))
        assert stream.entered.wait(5)  # the writer took line 0 and is stuck in write
        started = time.monotonic()
        for number in range(1, 11):
            writer.emit(_record(number))
        assert time.monotonic() - started < 0.5  # the caller never waited
        assert writer.dropped == 7  # lines 1-3 wait, 4-10 are dropped
        stream.release.set()
    finally:
        writer.close()
    assert stream.getvalue().splitlines() == ["line 0", "line 1", "line 2", "line 3"]


def test_close_writes_the_backlog_and_stops_the_thread() -> None:
    stream = io.StringIO()
    writer = BackgroundWriter(stream)
    for number in range(500):
        writer.emit(_record(number))
    writer.close()
    assert stream.getvalue().splitlines() == [f"line {n}" for n in range(500)]
    assert not writer._thread.is_alive()  # the thread this test is about


def test_a_stalled_stream_does_not_hold_up_close_for_ever() -> None:
    stream = StalledStream()
    writer = BackgroundWriter(stream)
    writer.emit(_record(0))
    assert stream.entered.wait(5)
    writer.emit(_record(1))
    started = time.monotonic()
    writer.close()  # bounded: the stream never returns until released below
    assert time.monotonic() - started < 6.0
    stream.release.set()
