"""A follow-up kind for tests of the loop itself (proxy/background/followups.py): what it writes
is the test's (`_settle`), and what it counts is read back by outcome."""

from __future__ import annotations

import enum
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter

from idemproxy.proxy.background.followups import Ends, FollowUps
from idemproxy.store.ports import JobStore

Item = TypeVar("Item")


class Done(enum.StrEnum):
    WRITTEN = "written"
    DROPPED = "dropped"
    REFUSED = "refused"
    MOVED_ON = "moved_on"


class CountedFollowUps(FollowUps[Item, Done]):
    """A loop with no store (the subclass's `_settle` never reaches one) and its own counter."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        counter = Counter("t_followups", "test", ["outcome"], registry=self.registry)
        counted = {done: counter.labels(done.value) for done in Done}
        store: JobStore = None  # type: ignore[assignment]  # never reached: `_settle` is ours
        ends = Ends(Done.DROPPED, Done.REFUSED, Done.MOVED_ON)
        super().__init__(store, counted, ends=ends, max_items=100)

    def counted(self, outcome: Done) -> float:
        labels = {"outcome": outcome.value}
        return self.registry.get_sample_value("t_followups_total", labels) or 0.0

    def counts(self) -> dict[str, float]:
        """Every outcome counted at least once, by name."""
        return {done.value: self.counted(done) for done in Done if self.counted(done)}
