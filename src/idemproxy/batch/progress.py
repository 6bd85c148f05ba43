"""Showing a run as it goes: a live bar with rate and ETA on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Protocol, TextIO

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from idemproxy.batch.records import Outcome, ResultRecord
from idemproxy.batch.usage import Usage


class Reporter(Protocol):
    def start(self, total: int, completed: int) -> None: ...
    def advance(self, record: ResultRecord) -> None: ...
    def note(self, message: str) -> None: ...
    def finish(self) -> None: ...


class NullReporter:
    """Reports nothing: the default of the Python API."""

    def start(self, total: int, completed: int) -> None:
        pass

    def advance(self, record: ResultRecord) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def finish(self) -> None:
        pass


def describe_problem(record: ResultRecord) -> str | None:
    """One line for a result that needs attention, None for a done one."""
    if record.outcome is Outcome.DONE:
        return None
    answer = f"HTTP {record.status}" if record.status is not None else (record.error or "")
    code = f" {record.error_code}" if record.error_code else ""
    if record.outcome is Outcome.OMITTED:
        code = ", replayed without the body the proxy did not store"
    again = ", retried on rerun" if record.retryable else ""
    # SPEC §14: sent, and nothing said what it did: it may have been paid.
    doubt = "; may have executed: counted at its worst case" if record.worst_case else ""
    return (
        f"item {record.id!r}: {record.outcome.value} ({answer}{code}, "
        f"{record.attempts} attempt(s){again}{doubt})"
    )


class PlainReporter:
    """For logs and pipes: problems as they happen, and a line every tenth of the way."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream: TextIO | None = stream or sys.stderr
        self._total = self._completed = self._step = 0

    def start(self, total: int, completed: int) -> None:
        self._total, self._completed = total, completed
        self._step = max(1, total // 10)
        self.note(f"{total - completed} item(s) to send, {completed} already answered")

    def advance(self, record: ResultRecord) -> None:
        self._completed += 1
        problem = describe_problem(record)
        if problem:
            self.note(problem)
        if self._completed % self._step == 0 or self._completed == self._total:
            self.note(f"{self._completed}/{self._total} items")

    def note(self, message: str) -> None:
        """One line, or nothing once the stream is gone: a log pipe that died (`| head`, a
        collector restarted) must not stop the run halfway with its items in flight
        abandoned; the results file is the record, and the run goes on to its summary."""
        if self._stream is None:
            return
        try:
            print(message, file=self._stream, flush=True)
        except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
            self._stream = None

    def finish(self) -> None:
        pass


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.speed
        return Text(f"{speed:.1f}/s" if speed else "-/s", style="progress.data.speed")


class _BatchProgress(Progress):
    """The bar, and the counts on a line of their own so that both fit 80 columns."""

    counts = ""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        if self.counts:
            yield Text(self.counts, style="dim")


class RichReporter:
    """A live bar: done of total, rate, elapsed and ETA, and below it the counts so far."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = _BatchProgress(
            TextColumn("[bold]batch"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            _RateColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
        )
        self._task = self._progress.add_task("batch", total=None, start=False)
        self._counts = {outcome: 0 for outcome in Outcome}
        self._replayed = 0
        self._tokens = 0  # executed this run; a replay costs nothing (ledger.py)

    def start(self, total: int, completed: int) -> None:
        self._progress.update(self._task, total=total, completed=completed)
        self._progress.start_task(self._task)
        self._progress.start()

    def advance(self, record: ResultRecord) -> None:
        self._counts[record.outcome] += 1
        # A late answer to this batch's own try was executed and paid (ledger.py).
        free = record.replayed and not record.sent_before
        self._replayed += free
        usage = Usage.from_json(record.usage)
        if usage is not None and not free:
            self._tokens += usage.total_tokens
        problem = describe_problem(record)
        if problem:
            self.note(problem)
        counts = self._counts
        self._progress.counts = (
            f"this run: done {counts[Outcome.DONE]} (replayed {self._replayed}) · "
            f"failed {counts[Outcome.FAILED]} · unknown {counts[Outcome.UNKNOWN]}"
            + (f" · omitted {counts[Outcome.OMITTED]}" if counts[Outcome.OMITTED] else "")
            + (f" · tokens {self._tokens:,}" if self._tokens else "")
        )
        self._progress.update(self._task, advance=1)

    def note(self, message: str) -> None:
        self._progress.console.print(message, markup=False, highlight=False)

    def finish(self) -> None:
        self._progress.stop()
