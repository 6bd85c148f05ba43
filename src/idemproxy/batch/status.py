"""`idemproxy batch status`: how far a run got, from the results file alone; nothing is sent."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from idemproxy.batch.checkpoint import TornLine, read_checkpoint
from idemproxy.batch.input import Item, read_input
from idemproxy.batch.keys import request_hash
from idemproxy.batch.ledger import Ledger
from idemproxy.batch.prices import PriceTable
from idemproxy.batch.records import Outcome, ResultRecord
from idemproxy.batch.summary import FILE_REPLAY_NOTE, RUN_REPLAY_NOTE, done_counts, is_late
from idemproxy.constants import DEFAULT_KEY_HEADER


@dataclass
class BatchStatus:
    results: str
    lines: int = 0
    torn: TornLine | None = None
    unterminated: int | None = None  # a whole last result without its newline: completed
    done: int = 0
    replayed: int = 0  # answered from an execution this batch did not start: cost nothing
    answered_late: int = 0  # replays of executions this batch's unanswered tries started: paid
    failed: int = 0
    retryable: int = 0  # of `failed`: a rerun tries them again
    unknown: int = 0
    omitted: int = 0  # executed once; the proxy replays them without the body it did not store
    # Known only with the input file:
    items: int | None = None
    invalid: int | None = None
    pending: int | None = None  # no result yet
    changed: int | None = None  # the result is for an earlier version of the item
    extra: int | None = None  # results for ids that are not in the input
    # Tokens (and money, with a price table) over every line of the file (ledger.py).
    ledger: Ledger = field(default_factory=Ledger)
    last_run: str | None = None  # when the run that wrote the last line started
    last_run_ledger: Ledger = field(default_factory=Ledger)
    prices: PriceTable | None = None

    def to_json(self) -> dict[str, Any]:
        report: dict[str, Any] = {}
        for item in fields(self):
            if item.name not in ("ledger", "last_run_ledger", "prices"):
                value = getattr(self, item.name)
                report[item.name] = value.__dict__.copy() if isinstance(value, TornLine) else value
        report["usage"] = self.ledger.to_json(self.prices)
        report["last_run_usage"] = (
            self.last_run_ledger.to_json(self.prices) if self.last_run is not None else None
        )
        return report

    def describe(self) -> str:
        lines = [f"{self.results}: {self.lines} line(s)"]
        if self.torn is not None:
            lines.append(
                f"  torn last line {self.torn.line} ({self.torn.size} bytes): "
                "repaired by the next run"
            )
        if self.unterminated is not None:
            lines.append(
                f"  last line {self.unterminated} lacks its newline: added by the next run"
            )
        if self.items is not None:
            lines.append(f"  input items {self.items}" + _invalid(self.invalid))
        lines.append(f"  done     {done_counts(self.done, self.replayed, self.answered_late)}")
        retried = f" ({self.retryable} retried on rerun)" if self.retryable else ""
        lines.append(f"  failed   {self.failed}{retried}")
        lines.append(f"  unknown  {self.unknown}")
        if self.omitted:
            lines.append(
                f"  omitted  {self.omitted} (executed once, but the proxy kept no body to "
                "replay; not sent again: raise its max_stored_body above the largest answer)"
            )
        for name in ("changed", "pending", "extra"):
            value = getattr(self, name)
            if value is not None:
                lines.append(f"  {name:<8} {value}")
        if self.ledger.metered or self.prices is not None:  # else: not an API that bills
            usage = self.ledger.describe(self.prices, replay_note=FILE_REPLAY_NOTE)
            lines.append(f"  tokens   {usage[0]}")
            lines.extend(f"           {line}" for line in usage[1:])
            if self.last_run is not None:
                last = self.last_run_ledger.describe(self.prices, replay_note=RUN_REPLAY_NOTE)
                lines.append(f"  last run (started {self.last_run}): {last[0]}")
                lines.extend(f"           {line}" for line in last[1:])
        return "\n".join(lines)


def _invalid(count: int | None) -> str:
    return f" ({count} invalid line(s) not counted)" if count else ""


def batch_status(
    results: Path,
    input_path: Path | None = None,
    *,
    key_header: str = DEFAULT_KEY_HEADER,
    prices: PriceTable | None = None,
) -> BatchStatus:
    checkpoint = read_checkpoint(results)
    status = BatchStatus(str(results), checkpoint.lines, checkpoint.torn, checkpoint.unterminated)
    status.ledger, status.prices = checkpoint.ledger, prices
    status.last_run, status.last_run_ledger = checkpoint.last_run, checkpoint.last_run_ledger
    records = checkpoint.records
    if input_path is None:
        _tally(status, records.values())
        return status
    source = read_input(input_path, skip_invalid=True, key_header=key_header)
    status.items, status.invalid = len(source.items), len(source.invalid)
    current = _current(source.items, records, status)
    _tally(status, current)
    status.extra = len(set(records) - {item.id for item in source.items})
    return status


def _current(
    items: list[Item], records: dict[str, ResultRecord], status: BatchStatus
) -> list[ResultRecord]:
    """The results that answer the input as it is now; counts pending and changed items."""
    status.pending = status.changed = 0
    current: list[ResultRecord] = []
    for item in items:
        record = records.get(item.id)
        if record is None:
            status.pending += 1
        elif record.request_hash != request_hash(item):
            status.changed += 1
        else:
            current.append(record)
    return current


def _tally(status: BatchStatus, records: Iterable[ResultRecord]) -> None:
    for record in records:
        if record.outcome is Outcome.DONE:
            status.done += 1
            status.replayed += int(record.replayed and not record.sent_before)
            status.answered_late += int(is_late(record))
        elif record.outcome is Outcome.FAILED:
            status.failed += 1
            status.retryable += int(record.retryable)
        elif record.outcome is Outcome.OMITTED:
            status.omitted += 1
        else:
            status.unknown += 1
