"""`idemproxy batch export --failed`: the input lines of the items that need another look.

The results file holds no requests (their headers may carry credentials), so the lines come
from the input file, byte for byte: sent again, each item has the same request hash and so the
same key (keys.py) — behind the proxy a rerun replays what already executed, never pays again.

Exported: the items whose current result (for the item as the input has it now, as `batch
status --input` counts them) is `failed` or `unknown`. Left out, and counted on stderr:
`omitted` items — they executed once and were paid for; sending them again only replays their
empty answer, or, after an operator deleted the job, pays again — and items with no result yet
or a result for an earlier version (a rerun of the input sends those anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from idemproxy.batch.checkpoint import read_checkpoint
from idemproxy.batch.errors import InvalidInput
from idemproxy.batch.input import read_input
from idemproxy.batch.keys import request_hash
from idemproxy.batch.records import Outcome
from idemproxy.constants import DEFAULT_KEY_HEADER

_EXPORTED = (Outcome.FAILED, Outcome.UNKNOWN)


@dataclass
class Export:
    lines: list[bytes] = field(default_factory=list)  # input lines, each ending in a newline
    counts: dict[Outcome, int] = field(default_factory=lambda: dict.fromkeys(Outcome, 0))
    pending: int = 0
    changed: int = 0

    def describe(self) -> str:
        counts = self.counts
        text = (
            f"exported {len(self.lines)} item(s): {counts[Outcome.FAILED]} failed, "
            f"{counts[Outcome.UNKNOWN]} unknown"
        )
        left_out = []
        if counts[Outcome.OMITTED]:
            left_out.append(
                f"{counts[Outcome.OMITTED]} omitted (executed once and paid for; sending them "
                "again cannot bring their answer back)"
            )
        if self.pending:
            left_out.append(f"{self.pending} without a result yet")
        if self.changed:
            left_out.append(f"{self.changed} changed since their result was written")
        return text + (f"; left out {', '.join(left_out)}" if left_out else "")


def export_failed(
    results: Path, input_path: Path, *, key_header: str = DEFAULT_KEY_HEADER
) -> Export:
    checkpoint = read_checkpoint(results)
    source = read_input(input_path, skip_invalid=True, key_header=key_header)
    try:
        raw_lines = input_path.read_bytes().split(b"\n")
    except OSError as exc:
        raise InvalidInput([f"{input_path}: {exc.strerror or exc}"]) from exc
    export = Export()
    for item in source.items:
        record = checkpoint.records.get(item.id)
        if record is None:
            export.pending += 1
        elif record.request_hash != request_hash(item):
            export.changed += 1
        else:
            export.counts[record.outcome] += 1
            if record.outcome in _EXPORTED:
                export.lines.append(raw_lines[item.line - 1] + b"\n")
    return export
