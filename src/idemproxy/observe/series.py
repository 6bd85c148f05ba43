"""The request path's counters and histograms: kept by the event loop, exposed at scrape time.

prometheus_client's `Histogram.observe` is five calls and two lock round trips (its sum's and
its bucket's), and `Counter.inc` four calls and one: every request pays several of each, on a
thread that alone updates them (the event loop's: the store's, the upstream's and the request's
timings are all taken there). These keep a series as plain numbers updated in one call, and a
collector turns them into the same exposition at scrape time (also on the loop, SPEC §13): the
same names, help, labels, buckets and `_created` series as prometheus_client's own would give.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class CounterSeries:
    """One labelled counter: `inc` as prometheus_client's (never negative)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramSeries:
    """One labelled histogram: each observation counted in the first bucket whose bound is at
    least the value (`le`), the last bucket being +Inf; the counts made cumulative when
    exposed.

    `observe` is the list's own `append`: an observation on the request's path is one C call,
    no frame of ours (bench/calls.py). The values are sorted into the buckets when the series
    is read (`counts`, `sum`, a scrape) and by `fold`, which the app runs every
    `FOLD_INTERVAL_SECONDS`, so the list stays short when nobody scrapes. An observation may
    come from another thread (the collector's hook): `fold` takes only what it read, and an
    append meanwhile stays for the next one."""

    __slots__ = ("_counts", "_pending", "_sum", "bounds", "created", "observe")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self.created = time.time()
        self._pending: list[float] = []
        self.observe: Callable[[float], None] = self._pending.append

    def fold(self) -> None:
        pending = self._pending
        taken = len(pending)
        if not taken:
            return
        values = pending[:taken]
        del pending[:taken]
        counts, bounds, total = self._counts, self.bounds, self._sum
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            total += value  # in order, as prometheus_client's sum
        self._sum = total

    @property
    def waiting(self) -> int:
        """Observations not yet folded into the buckets."""
        return len(self._pending)

    @property
    def counts(self) -> list[int]:
        self.fold()
        return self._counts

    @property
    def sum(self) -> float:
        self.fold()
        return self._sum


S = TypeVar("S", "CounterSeries", "HistogramSeries")


class _Family(Collector, Generic[S]):
    """A labelled family: its series by label values, each made on first use (`_new`)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], S] = {}
        registry.register(self)

    def labels(self, *values: object) -> S:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected")
        key = tuple(map(str, values))
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = self._new()
        return series

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def _new(self) -> S:
        raise NotImplementedError

    def _family(self) -> Metric:
        raise NotImplementedError

    def collect(self) -> Iterable[Metric]:
        raise NotImplementedError


class LoopCounter(_Family[CounterSeries]):
    """A labelled counter (`NAME_total`, `NAME_created`), as prometheus_client's `Counter`."""

    def _new(self) -> CounterSeries:
        return CounterSeries()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for values, series in list(self._series.items()):
            family.add_metric(values, series.value, created=series.created)
        yield family


class LoopHistogram(_Family[HistogramSeries]):
    """A labelled histogram (`_bucket`, `_count`, `_sum`, `_created`), as prometheus_client's
    `Histogram` with the same bounds (+Inf added)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        super().__init__(name, documentation, labelnames, registry)
        bounds = tuple(sorted(float(bound) for bound in buckets if bound != float("inf")))
        self._bounds = bounds
        self._les = [*map(floatToGoString, bounds), "+Inf"]

    def _new(self) -> HistogramSeries:
        return HistogramSeries(self._bounds)

    def fold(self) -> None:
        for series in list(self._series.values()):
            series.fold()

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for values, series in list(self._series.items()):
            counts, total = list(series.counts), series.sum  # one snapshot of the counts
            cumulative, buckets = 0, []
            for le, count in zip(self._les, counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(values, buckets, total)
            created = dict(zip(self.labelnames, values, strict=True))
            family.add_sample(f"{self.name}_created", created, series.created)
        yield family


# Folded this often, the observations waiting in a busy process's series stay in the thousands.
FOLD_INTERVAL_SECONDS = 0.25


async def fold_forever(
    histograms: Sequence[LoopHistogram], interval: float = FOLD_INTERVAL_SECONDS
) -> None:
    """Sort the histograms' waiting observations into their buckets, until cancelled."""
    while True:
        await asyncio.sleep(interval)
        for histogram in histograms:
            histogram.fold()
