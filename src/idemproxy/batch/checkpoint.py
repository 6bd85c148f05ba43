"""The results file: an append-only JSONL checkpoint, fsynced line by line (SPEC §14).

Each result is written as one complete line with a single `write` on an `O_APPEND` descriptor
and fsynced before the runner moves on, so a crash at any moment loses at most the items in
flight, and lines never interleave. Only the last line can be torn (the process died inside
that write): it lacks its newline, and it is cut off on the next run only if it is a strict
prefix of a result line (it starts as every result line does, and is not whole JSON) — its item
is then sent again under the same key, and the proxy replays it instead of executing it again.
A whole result that only lacks its newline is kept and given the newline. Any other last line
without a newline, and any other line that is not a result, is a file we did not write (an
`--output` pointing at the wrong file): the run stops and the file is left as it is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from idemproxy.batch.errors import (
    BatchError,
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointUnwritable,
)
from idemproxy.batch.ledger import Ledger
from idemproxy.batch.records import LINE_START, ResultRecord

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, one run at a time is on you
    fcntl = None  # type: ignore[assignment]


@dataclass(frozen=True)
class TornLine:
    line: int  # 1-based line number of the torn line
    size: int  # bytes cut off


@dataclass
class Checkpoint:
    """What the results file holds: the last record of each id (a later line wins), and the
    usage ledger of all its lines (ledger.py)."""

    records: dict[str, ResultRecord] = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)
    last_run: str | None = None  # the `run` of the last line
    last_run_ledger: Ledger = field(default_factory=Ledger)  # the lines of that run
    lines: int = 0
    torn: TornLine | None = None
    unterminated: int | None = None  # line number of a whole last result without its newline
    keys: RunKeys | None = None  # the keys the last run sent its items under (`RunKeys`)


@dataclass(frozen=True)
class RunKeys:
    """The keys a run sends its items under (`--key-prefix`, `--key-header`), kept beside the
    results file (`<results>.keys`) and made durable before the run sends anything. A run
    stopped before its first answer leaves no result line, and its items may be in flight under
    these keys: a resume under other keys would send them again and pay twice (SPEC §14). Not
    a line of the results file, which holds results only."""

    prefix: str
    header: str

    @staticmethod
    def path_of(results: Path) -> Path:
        """Beside the results file itself: a symbolic link to it names the same keys."""
        real = results.resolve()
        return real.with_name(real.name + ".keys")

    @classmethod
    def read(cls, results: Path) -> RunKeys | None:
        """The keys kept beside `results`, None when there are none. One that cannot be read
        stops the run: taken for none, a resume under other keys would go through."""
        path = cls.path_of(results)
        try:
            value = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except ValueError:
            value = None
        prefix = value.get("prefix") if isinstance(value, dict) else None
        header = value.get("header") if isinstance(value, dict) else None
        if not isinstance(prefix, str) or not isinstance(header, str):
            raise CheckpointCorrupt(
                f"{path} does not say which keys the last run sent its items under; remove it"
                " only if no run on these results was stopped with items in flight"
            )
        return cls(prefix, header)


def read_checkpoint(path: Path) -> Checkpoint:
    """Read without changing anything (for `batch status`); a missing file is empty."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Checkpoint()
    return parse_checkpoint(data, path)


def parse_checkpoint(data: bytes, path: Path) -> Checkpoint:
    complete, newline, rest = data.rpartition(b"\n")
    body = complete + newline if newline else b""
    tail = rest if newline else data
    checkpoint = Checkpoint()
    for number, raw in enumerate(body.split(b"\n")[:-1], start=1):
        checkpoint.lines = number
        if not raw.strip():
            continue
        try:
            record = _record(raw)
        except ValueError as exc:
            raise CheckpointCorrupt(f"{path}: line {number} is not a result ({exc})") from exc
        _add(checkpoint, record)
    if tail:
        _last_line(checkpoint, tail, path)
    return checkpoint


def _add(checkpoint: Checkpoint, record: ResultRecord) -> None:
    checkpoint.records[record.id] = record
    checkpoint.ledger.add(record)
    # A run's lines are contiguous: the file is locked while a run writes it.
    if record.run != checkpoint.last_run or record.run is None:
        checkpoint.last_run, checkpoint.last_run_ledger = record.run, Ledger()
    checkpoint.last_run_ledger.add(record)


def _record(raw: bytes) -> ResultRecord:
    return ResultRecord.from_object(_json(raw))


def _json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except RecursionError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError("nested too deep") from exc


def _last_line(checkpoint: Checkpoint, tail: bytes, path: Path) -> None:
    """A last line without its newline: a whole result, a torn one, or a file that is not ours."""
    number = checkpoint.lines + 1
    try:
        value = _json(tail)
    except ValueError:
        # Not whole JSON: a torn result if it begins as every result line does (a strict
        # prefix of one), else someone else's bytes.
        if tail.startswith(LINE_START) or LINE_START.startswith(tail):
            checkpoint.torn = TornLine(number, len(tail))
            return
        value = None
    try:
        record = ResultRecord.from_object(value)
    except ValueError:
        raise CheckpointCorrupt(
            f"{path}: its last line {number} has no newline and is not a result nor the start "
            "of one; left as it is (is this the results file of a batch run?)"
        ) from None
    _add(checkpoint, record)
    checkpoint.lines, checkpoint.unterminated = number, number


class CheckpointWriter:
    """The results file opened for one run: locked, repaired, appended to line by line."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def open(cls, path: Path) -> tuple[CheckpointWriter, Checkpoint]:
        try:
            return cls._open(path)
        except OSError as exc:
            raise BatchError(f"cannot open {path}: {exc.strerror or exc}") from exc

    @classmethod
    def _open(cls, path: Path) -> tuple[CheckpointWriter, Checkpoint]:
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
        try:
            _lock(fd, path)
            if created:
                _fsync_directory(path.parent)  # the new file's name survives a power cut too
            checkpoint = parse_checkpoint(path.read_bytes(), path)
            checkpoint.keys = RunKeys.read(path)
            if checkpoint.torn is not None:
                _repair(fd, path.stat().st_size - checkpoint.torn.size)
            elif checkpoint.unterminated is not None:
                _terminate(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd), checkpoint

    def append(self, record: ResultRecord) -> None:
        """Write one line and fsync it.

        Deliberately synchronous: nothing can interleave or cancel between the write and the
        fsync, so a Ctrl-C or a sibling worker never leaves half a line behind.
        """
        view = memoryview(record.to_line())
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as exc:
            # The item's request went through; a rerun sends it again under the same key and
            # the proxy replays the answer, so stopping here loses nothing that was paid for.
            raise CheckpointUnwritable(
                f"cannot write {self.path}: {exc.strerror or exc}; rerun once fixed"
            ) from exc

    def keep_keys(self, keys: RunKeys) -> None:
        """Write `keys` beside the results, durably (a whole new file, renamed into place)."""
        target = RunKeys.path_of(self.path)
        staging = target.with_name(target.name + ".new")
        data = json.dumps({"prefix": keys.prefix, "header": keys.header}).encode() + b"\n"
        try:
            fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(staging, target)
            _fsync_directory(target.parent)
        except OSError as exc:
            raise CheckpointUnwritable(
                f"cannot write {target}: {exc.strerror or exc}; nothing was sent"
            ) from exc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing releases the lock
            self._fd = -1


def _lock(fd: int, path: Path) -> None:
    if fcntl is None:  # pragma: no cover
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise CheckpointLocked(f"another batch run is writing {path}") from exc


def _repair(fd: int, size: int) -> None:
    os.ftruncate(fd, size)
    os.fsync(fd)


def _terminate(fd: int) -> None:
    os.write(fd, b"\n")  # O_APPEND: right after the whole record the file ends with
    os.fsync(fd)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
