"""The batch runner's errors, under the package's one root (`IdemproxyError`).

    IdemproxyError
    └── BatchError                  the batch cannot start or go on
        ├── InvalidInput            bad input lines (each named by its line number)
        ├── CheckpointCorrupt       a results line that is not ours, other than a torn last line
        ├── CheckpointLocked        another run is writing the same results file
        ├── CheckpointUnwritable    a result could not be written (disk full, I/O error)
        ├── KeyPrefixChanged        the results were written under other idempotency keys
        └── KeyHeaderChanged        the results were written with another key header

Docstrings are the default message.
"""

from __future__ import annotations

from collections.abc import Sequence

from idemproxy.errors import IdemproxyError


class BatchError(IdemproxyError):
    """The batch cannot run."""


class InvalidInput(BatchError):
    """The input file has invalid lines."""

    def __init__(self, problems: Sequence[str], *, hint: str = "") -> None:
        self.problems = list(problems)
        shown = self.problems[:20]
        more = len(self.problems) - len(shown)
        lines = [f"{len(self.problems)} invalid input line(s):", *(f"  {p}" for p in shown)]
        if more:
            lines.append(f"  … and {more} more")
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


class CheckpointCorrupt(BatchError):
    """The results file has a line that is not a result; fix or remove it."""


class CheckpointLocked(BatchError):
    """Another batch run is writing this results file."""


class CheckpointUnwritable(BatchError):
    """A result could not be written; rerun once fixed: items in flight are replayed."""


class KeyPrefixChanged(BatchError):
    """The results file was written with another --key-prefix."""


class KeyHeaderChanged(BatchError):
    """The results file was written with another --key-header."""
