"""Log set-up: plain text or one JSON object per line (SPEC §13)."""

from __future__ import annotations

import json
import logging
import sys
import time

_HANDLER_NAME = "idemproxy"
_QUIET_LIBRARIES = ("aiosqlite", "asyncpg", "redis")
_PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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

    def formatMessage(self, record: logging.LogRecord) -> str:
        return f"{record.asctime} {record.levelname} {record.name}: {record.message}"


class JsonFormatter(_SecondCache):
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
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(PlainFormatter())
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if h.get_name() != _HANDLER_NAME] + [handler]
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
