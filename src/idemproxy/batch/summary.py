"""What a run did, counted as results arrive, and how it reads at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from idemproxy.batch.budget import Limits
from idemproxy.batch.checkpoint import TornLine
from idemproxy.batch.ledger import Ledger
from idemproxy.batch.prices import PriceTable
from idemproxy.batch.records import Outcome, ResultRecord

RUN_REPLAY_NOTE = "cost nothing now: paid once, when first executed"
FILE_REPLAY_NOTE = "paid once, by the run that executed them, and not again"
# SPEC §14: a replay answering a try of this batch that was sent and not answered.
LATE_NOTE = "answered late: replays of executions this batch's own unanswered tries started, paid"


def done_counts(done: int, replayed: int, late: int) -> str:
    """`N (M replayed)`, and the late answers, which are executions of this batch's own."""
    late_text = f", {late} {LATE_NOTE}" if late else ""
    return f"{done} ({replayed} replayed{late_text})"


def is_late(record: ResultRecord) -> bool:
    return record.replayed and record.sent_before


@dataclass
class BatchSummary:
    total: int = 0  # valid input items
    invalid: int = 0  # input lines left out (--skip-invalid)
    skipped: int = 0  # already answered in the results file, not sent
    sent: int = 0  # items this run set out to send
    done: int = 0  # answered below 400 this run, replays included
    replayed: int = 0  # of `done`: answered by the proxy from an execution this batch did not start
    answered_late: int = 0  # of `done`: replays of executions this batch's unanswered tries started
    failed: int = 0
    retryable: int = 0  # of `failed`: retries ran out; a rerun tries again under the same key
    unknown: int = 0
    # Executed once, but replayed without the body the proxy did not store (SPEC §7): the
    # answer is lost, and a rerun cannot bring it back.
    omitted: int = 0
    changed: int = 0  # edited since their result was written; left out
    earlier_failed: int = 0  # skipped items whose recorded result is a failure
    earlier_unknown: int = 0
    earlier_omitted: int = 0
    torn: TornLine | None = None
    unterminated: int | None = None  # line number of a whole last result given its newline
    stopped: bool = False
    elapsed: float = 0.0
    ledger: Ledger = field(default_factory=Ledger)  # this run's answers (ledger.py)
    file_ledger: Ledger = field(default_factory=Ledger)  # the whole results file, this run's too
    prices: PriceTable | None = None
    limits: Limits = field(default_factory=Limits)
    budget_stop: str | None = None  # why the budget stopped the run (budget.py)
    rate_limit_pauses: int = 0  # 429/503 answers that paused every worker (ratelimit.py)

    def count(self, record: ResultRecord) -> None:
        self.ledger.add(record)
        self.file_ledger.add(record)
        if record.outcome is Outcome.DONE:
            self.done += 1
            self.replayed += record.replayed and not record.sent_before
            self.answered_late += is_late(record)
        elif record.outcome is Outcome.FAILED:
            self.failed += 1
            self.retryable += record.retryable
        elif record.outcome is Outcome.OMITTED:
            self.omitted += 1
        else:
            self.unknown += 1

    @property
    def interrupted(self) -> int:
        """Items this run did not answer because it was stopped."""
        return self.sent - self.done - self.failed - self.unknown - self.omitted

    @property
    def outstanding(self) -> int:
        """Items that still lack a `done` result."""
        return (
            self.failed
            + self.unknown
            + self.omitted
            + self.changed
            + self.interrupted
            + self.earlier_failed
            + self.earlier_unknown
            + self.earlier_omitted
        )

    @property
    def complete(self) -> bool:
        return self.outstanding == 0

    def describe(self) -> str:
        parts = [
            f"done {done_counts(self.done, self.replayed, self.answered_late)}",
            f"failed {self.failed}" + (f" ({self.retryable} retryable)" if self.retryable else ""),
            f"unknown {self.unknown}",
            f"skipped {self.skipped}",
        ]
        lost = self.omitted + self.earlier_omitted
        if lost:
            parts.append(
                f"omitted {lost} (executed once, but the proxy kept no body to replay: "
                "raise its max_stored_body above the largest answer)"
            )
        if self.changed:
            parts.append(f"changed {self.changed}")
        if self.interrupted:
            parts.append(f"left to resume {self.interrupted}")
        if self.invalid:
            parts.append(f"invalid lines left out {self.invalid}")
        verdict = "complete" if self.complete else f"{self.outstanding} item(s) not done"
        head = "stopped" if self.stopped or self.budget_stop else "finished"
        first = (
            f"{head} in {self.elapsed:.1f}s — {self.total} items: {', '.join(parts)} — {verdict}"
        )
        return "\n".join([first, *self._metering()])

    def _metering(self) -> list[str]:
        lines: list[str] = []
        if self.file_ledger.metered or self.prices is not None or self.limits.active:
            lines += _block(
                "this run", self.ledger.describe(self.prices, replay_note=RUN_REPLAY_NOTE)
            )
            lines += _block(
                "results file",
                self.file_ledger.describe(self.prices, replay_note=FILE_REPLAY_NOTE),
            )
        if self.rate_limit_pauses:
            lines.append(
                f"rate limited: {self.rate_limit_pauses} answer(s) 429/503 paused every worker "
                "for what they asked"
            )
        if self.budget_stop:
            done = self.skipped_done + self.done
            lines.append(
                f"budget reached, {self.budget_stop}; {done} of {self.total} items done, "
                f"{self.interrupted} not started: rerun with a higher limit to resume"
            )
        return lines

    @property
    def skipped_done(self) -> int:
        """Skipped items whose recorded result is `done`."""
        return self.skipped - self.earlier_failed - self.earlier_unknown - self.earlier_omitted


def _block(title: str, lines: list[str]) -> list[str]:
    indent = " " * (len(title) + 2)
    return [f"{title}: {lines[0]}", *(indent + line for line in lines[1:])]
