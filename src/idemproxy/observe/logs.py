"""Log set-up: plain text or one JSON object per line (SPEC §13), written off the event loop.

A line is formatted where it is logged and written to stderr by a thread of its own
(`BackgroundWriter`). Written in place, a reader of stderr that stops reading (a log collector
that stalls, a full pipe) would block the event loop in `write`: every request of the process
would stop, held duplicates with them, and the leases of attempts in flight would run out, so
other replicas would take those jobs over as `unknown` (SPEC §3.5). Here only the writer waits;
up to `LOG_BACKLOG_LINES` lines queue behind it, and further ones are dropped and counted
(`idemproxy_log_lines_dropped_total`). While lines keep coming the writer looks for them every
`_LINGER_SECONDS` rather than being woken for each one: handing a line over is a `deque.append`.
"""

from __future__ import annotations

import collections
import json
import logging
import sys
import threading
import time
from typing import TextIO

from idemproxy.http.headers import CURRENT, Correlation, current_fields

_HANDLER_NAME = "idemproxy"
# Lines that may wait for a slow stderr (about 2 MB of request lines) before lines are dropped.
LOG_BACKLOG_LINES = 10_000
# How long the exit waits for the writer to empty its backlog into a stderr that may be stalled.
_EXIT_FLUSH_SECONDS = 2.0
# How long the writer waits for more lines after a write before it sleeps until woken: a line
# waits at most this long while lines keep coming, and the loop wakes no thread per line.
_LINGER_SECONDS = 0.05
_QUIET_LIBRARIES = ("asyncpg", "redis")
_PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_PLAIN_DEFAULT = logging.Formatter()  # what logging.Handler.format uses without a formatter


class _SecondCache(logging.Formatter):
    """`formatTime` as the stock one formats it, with the date and time up to the second made
    once per second rather than once per line (`localtime` and `strftime`, on every request)."""

    def __init__(self, fmt: str | None = None) -> None:
        super().__init__(fmt)
        # One tuple, replaced whole: a thread that logs at the same time reads a consistent pair.
        self._second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt or not self.default_msec_format:
            return super().formatTime(record, datefmt)
        second, stamp = self._second
        if int(record.created) != second:
            second = int(record.created)
            stamp = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = (second, stamp)
        return self.default_msec_format % (stamp, record.msecs)


class PlainFormatter(_SecondCache):
    """`time level logger: message`, one line per record (docs/operations.md, Logs).

    The format is fixed, so the line is joined directly rather than by `%`-formatting with the
    record's whole `__dict__` (6,000 fewer instructions per request line, bench/compare)."""

    def __init__(self) -> None:
        super().__init__(_PLAIN)

    def usesTime(self) -> bool:
        return True

    def format(self, record: logging.LogRecord) -> str:
        """The stock `format`'s steps for a record without a traceback or stack (every request
        line), with `formatTime` and `formatMessage` written out: one call into this module,
        not three."""
        if record.exc_info or record.exc_text or record.stack_info:
            return super().format(record)
        record.message = record.getMessage()
        second, stamp = self._second
        msec_format = self.default_msec_format
        if msec_format and int(record.created) == second:  # `formatTime`'s common case
            record.asctime = msec_format % (stamp, record.msecs)
        else:
            record.asctime = self.formatTime(record)
        line = f"{record.asctime} {record.levelname} {record.name}: {record.message}"
        correlation = CURRENT.get()  # `formatMessage`, in place
        if correlation is None:
            return line
        if correlation.trace_id is None:  # `Correlation.fields`' common case, in place
            return f"{line} request_id={correlation.request_id}"
        return f"{line} {_ids(correlation)}"

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The line of a record with a traceback or stack (the stock `format` adds them)."""
        line = f"{record.asctime} {record.levelname} {record.name}: {record.message}"
        correlation = CURRENT.get()
        return line if correlation is None else f"{line} {_ids(correlation)}"


def _ids(correlation: Correlation) -> str:
    return " ".join(map("=".join, correlation.fields().items()))  # `name=value`, in C


class JsonFormatter(logging.Formatter):
    """One JSON object per line; `time` in RFC 3339 UTC with milliseconds
    (`2026-12-01T19:29:08.305Z`), the form log pipelines parse without a pattern."""

    def __init__(self) -> None:
        super().__init__()
        # As _SecondCache: one tuple, the date and time up to the second made once per second.
        self._second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second, stamp = self._second
        if int(record.created) != second:
            second = int(record.created)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = (second, stamp)
        return f"{stamp}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update({k: v for k, v in fields.items() if v is not None})
        entry.update(current_fields())
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class BackgroundWriter(logging.Handler):
    """Formats on the caller's thread; a daemon thread writes the lines, several per write."""

    def __init__(self, stream: TextIO, *, backlog: int = LOG_BACKLOG_LINES) -> None:
        super().__init__()
        self._stream = stream
        self._backlog = backlog
        # deque.append and popleft are atomic: the event loop never waits for the writer.
        self._lines: collections.deque[str] = collections.deque()
        self._wake = threading.Event()
        # Set by the writer just before it waits: only then does a line need to wake it (an
        # Event.set takes a lock, on every request).
        self._asleep = False
        self._idle = threading.Event()
        self._stalled = False  # a flush waited in vain; cleared when the writer catches up
        self._closing = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._write_forever, name="idemproxy-log")
        self._thread.daemon = True  # a stderr stalled for good must not keep the process alive
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # The formatter called directly, as logging.Handler.format would: one call less
            # on every governed request's line.
            line = (self.formatter or _PLAIN_DEFAULT).format(record)
        except Exception:  # logging's own policy: report, never raise
            self.handleError(record)
            return
        if len(self._lines) >= self._backlog:
            self.dropped += 1
            return
        self._lines.append(line)
        if self._asleep:  # read after the append: see _write_forever
            self._wake.set()

    def flush(self) -> None:
        """Wait (bounded) until every queued line was handed to the stream, the batch being
        written too (taken off the queue already): the writer says so when it comes round.
        Once a wait ran out (the stream is stalled), the next ones do not wait again until
        the writer catches up: at exit `logging.shutdown` flushes and then closes, and the
        whole exit waits `_EXIT_FLUSH_SECONDS` at most, not once per step."""
        if self._thread.is_alive() and not self._stalled:
            self._idle.clear()
            self._wake.set()
            self._stalled = not self._idle.wait(_EXIT_FLUSH_SECONDS)

    def close(self) -> None:
        self._closing = True
        self.flush()
        self._wake.set()
        self._thread.join(0.0 if self._stalled else _EXIT_FLUSH_SECONDS)
        super().close()

    def _write_forever(self) -> None:
        """Wait for lines; then write what is queued, and look again `_LINGER_SECONDS` later,
        until a look finds nothing. Lines come in streams: each one woken for cost the event
        loop a lock and a condition per request (11 futex calls, 6 % of the proxy's CPU at c=1,
        measured); while the writer lingers, `emit` only appends (`_asleep` is False). One
        function: the writer wakes during requests, and its calls count among theirs
        (bench/calls.py)."""
        lines = self._lines
        while True:
            # Asleep first, then look: a line appended before `_asleep` was set is seen here,
            # and one appended after it sets `_wake` (emit reads `_asleep` after appending).
            self._asleep = True
            if not lines:
                self._stalled = False
                self._idle.set()
                if self._closing:
                    return
                self._wake.wait()
            self._asleep = False
            self._wake.clear()
            while True:
                while lines:
                    # Up to 256 lines a write. A loop, not a comprehension: that is a call of
                    # its own on Python 3.11, on every write.
                    batch = []
                    for _ in range(min(len(lines), 256)):
                        batch.append(lines.popleft())
                    try:
                        self._stream.write("\n".join(batch) + "\n")
                        self._stream.flush()
                    except (OSError, ValueError):  # stderr closed: nothing more can be written
                        self.dropped += len(batch)
                if self._closing:
                    break
                time.sleep(_LINGER_SECONDS)
                if not lines:
                    break


def configure_logging(level: str, fmt: str) -> None:
    handler = BackgroundWriter(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(PlainFormatter())
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for previous in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(previous)
        previous.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Neither format shows the thread or the process, and each record would otherwise look
    # them up (a getpid system call among them): the logging HOWTO's "Optimization" advice,
    # a fifth of the cost of a request's log line (bench/findings.md).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    for name in _QUIET_LIBRARIES:
        # Their debug output carries SQL parameters, i.e. request and response bodies.
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    pool = logging.getLogger(_POOL_LOGGER)
    if not any(isinstance(f, OneLineFailure) for f in pool.filters):
        pool.addFilter(OneLineFailure())


# asyncpg's pool warns with a whole traceback each time it fails to reconnect while the server
# is away (several a second at first): the store's own lines already say that it is away.
_POOL_LOGGER = "asyncpg.pool"


class OneLineFailure(logging.Filter):
    """A library's warning of an expected failure, its exception on the same line instead of a
    traceback (an outage is not a bug)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.levelno < logging.ERROR:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def dropped_log_lines() -> int:
    """Lines the background writer had to drop so far (0 before `configure_logging`)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, BackgroundWriter):
            return handler.dropped
    return 0
