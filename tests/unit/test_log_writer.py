"""The background log writer (observe/logs.py): lines wait for a slow stderr up to a bound,
then are dropped and counted; nothing waits on the caller's thread."""

from __future__ import annotations

import io
import logging
import sys
import threading
import time

import pytest

from idemproxy.cli.main import main
from idemproxy.observe import logs
from idemproxy.observe.logs import BackgroundWriter


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


def _stuck_with_a_line_queued() -> tuple[StalledStream, BackgroundWriter]:
    """A writer stuck in writing line 0, with line 1 waiting behind it."""
    stream = StalledStream()
    writer = BackgroundWriter(stream)
    writer.emit(_record(0))
    assert stream.entered.wait(5)
    writer.emit(_record(1))
    return stream, writer


def test_a_stalled_stream_does_not_hold_up_close_for_ever() -> None:
    stream, writer = _stuck_with_a_line_queued()
    started = time.monotonic()
    writer.close()  # bounded: the stream never returns until released below
    assert time.monotonic() - started < 3.0
    stream.release.set()


def test_the_exit_waits_for_a_stalled_stream_once_not_at_each_step() -> None:
    """docs/operations.md, Logs: at exit the proxy waits up to 2 s for the backlog.
    `logging.shutdown` flushes, then closes (which flushes and joins): one wait in all."""
    stream, writer = _stuck_with_a_line_queued()
    started = time.monotonic()
    writer.flush()
    writer.close()
    assert time.monotonic() - started < 3.0
    stream.release.set()


def test_a_flush_waits_again_once_the_writer_caught_up() -> None:
    stream = StalledStream()
    writer = BackgroundWriter(stream)
    try:
        writer.emit(_record(0))
        assert stream.entered.wait(5)
        writer.flush()  # ran out: the stream is stalled
        stream.release.set()
        time.sleep(0.2)  # the writer comes round, finds nothing left, and says so
        writer.emit(_record(1))
        writer.flush()  # waits for line 1 again: it is written when flush returns
        assert stream.getvalue().splitlines() == ["line 0", "line 1"]
    finally:
        writer.close()


class CountingStream(io.StringIO):
    """A stderr that counts the writes it gets: one per wake-up of the writer at most."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_a_stream_of_lines_is_written_in_batches_without_a_wake_up_per_line() -> None:
    """Woken for every line, the writer cost the event loop a lock and a condition per request
    (11 futex calls at c=1); while lines keep coming it now looks for them every
    `_LINGER_SECONDS` instead, and every line is still written, in order."""
    stream = CountingStream()
    writer = BackgroundWriter(stream)
    started = time.monotonic()
    for number in range(100):
        writer.emit(_record(number))
        time.sleep(0.002)
    elapsed = time.monotonic() - started
    writer.close()
    assert stream.getvalue().splitlines() == [f"line {n}" for n in range(100)]
    # One write per wake-up: about one per 50 ms of the stream (it was one per line).
    assert stream.writes <= elapsed / logs._LINGER_SECONDS * 1.5 + 3, (stream.writes, elapsed)


class Transcript(io.StringIO):
    """sys.stderr for the command itself: its writes land in `lines` at once."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.written = threading.Event()

    def write(self, text: str) -> int:
        self.lines.append(text)
        self.written.set()
        return len(text)


class LaggingStream(io.StringIO):
    """The log writer's stderr, lagging: a write lands in the transcript only once the command
    wrote there itself, or after 1.5 s (within the bound of a flush)."""

    def __init__(self, transcript: Transcript) -> None:
        super().__init__()
        self.transcript = transcript

    def write(self, text: str) -> int:
        self.transcript.written.wait(1.5)
        self.transcript.lines.append(text)
        return len(text)


def test_a_failed_command_says_why_after_the_lines_it_logged_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The error that ends a command is the last word on stderr: lines still queued for the
    writer's thread when the command failed are written before it, not after."""
    transcript = Transcript()
    writer = BackgroundWriter(LaggingStream(transcript))
    root = logging.getLogger()
    root.addHandler(writer)
    monkeypatch.setattr(sys, "stderr", transcript)
    try:
        writer.emit(_record(1))  # queued: the writer is still writing it when the command fails
        assert main(["serve", "--upstream", "ftp://x"]) == 2
    finally:
        root.removeHandler(writer)
        writer.close()
    said = "".join(transcript.lines).splitlines()
    assert said[0] == "line 1", said
    assert said[-1].startswith("idemproxy: invalid configuration: upstream: "), said


def test_the_store_pool_s_reconnect_failures_are_one_line_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While PostgreSQL is away asyncpg's pool warns several times a second, each with a whole
    traceback; the store's own lines already say it is away."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    logs.configure_logging("INFO", "plain")
    try:
        try:
            raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")
        except ConnectionRefusedError:
            logging.getLogger("asyncpg.pool").warning(
                "Failed to restore the pool connection floor; retrying", exc_info=True
            )
        try:
            raise RuntimeError("a bug")
        except RuntimeError:
            logging.getLogger("asyncpg.pool").error("something broke", exc_info=True)
    finally:
        root = logging.getLogger()
        writer = root.handlers[-1]
        root.removeHandler(writer)
        writer.close()
    lines = stream.getvalue().splitlines()
    assert any(
        line.endswith(
            "WARNING asyncpg.pool: Failed to restore the pool connection floor; retrying:"
            " ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 5432)"
        )
        for line in lines
    ), lines
    assert "Traceback" in stream.getvalue()  # an error keeps its traceback
    assert stream.getvalue().count("Traceback") == 1
