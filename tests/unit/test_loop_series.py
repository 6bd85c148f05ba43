"""The request path's counters and histograms (observe/metrics.py) expose exactly what
prometheus_client's own would for the same observations (SPEC §13): dashboards, alerts and the
workers' merge (admin/peers.py) read the same text."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from collections.abc import Callable
from types import FrameType

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from idemproxy.observe.metrics import HistogramSeries, LoopCounter, LoopHistogram, fold_forever

BUCKETS = (0.0005, 0.001, 0.25, 1, 2.5, 60)
OBSERVED = (0.0, 0.0005, 0.0007, 0.25, 0.2500001, 1.0, 3.0, 60.0, 61.0, 1e9)
CREATED = re.compile(r"^(\S+_created\{[^}]*\}) \S+$", re.MULTILINE)


def _exposition(registry: CollectorRegistry) -> str:
    """The text, with each series' creation time (its own clock reading) left out."""
    return CREATED.sub(r"\1 T", generate_latest(registry).decode())


def test_a_histogram_exposes_what_prometheus_clients_would() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    labels = ["outcome", "route"]
    reference = Histogram("x_seconds", "Help.", labels, buckets=BUCKETS, registry=theirs)
    loop = LoopHistogram("x_seconds", "Help.", labels, ours, BUCKETS)
    for index, value in enumerate(OBSERVED):
        route = ("/pay", "/orders")[index % 2]
        reference.labels("new", route).observe(value)
        loop.labels("new", route).observe(value)
    reference.labels("held", "/pay")
    loop.labels("held", "/pay")  # bound, never observed: all zeros, as theirs
    assert _exposition(ours) == _exposition(theirs)


def test_a_counter_exposes_what_prometheus_clients_would() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Counter("x_requests", "Help.", ["outcome"], registry=theirs)
    loop = LoopCounter("x_requests", "Help.", ["outcome"], ours)
    for amount, outcome in ((1, "new"), (2.5, "new"), (1, "replayed")):
        reference.labels(outcome).inc(amount)
        loop.labels(outcome).inc(amount)
    reference.labels("unknown")
    loop.labels("unknown")
    assert _exposition(ours) == _exposition(theirs)
    assert loop.labels("new").value == 3.5


def test_wrong_label_counts_and_negative_increments_are_refused_as_theirs_are() -> None:
    loop = LoopCounter("x_requests", "Help.", ["outcome"], CollectorRegistry())
    with pytest.raises(ValueError):
        loop.labels("new", "extra")
    with pytest.raises(ValueError):
        loop.labels("new").inc(-1)
    histogram = LoopHistogram("x_seconds", "Help.", ["a"], CollectorRegistry(), BUCKETS)
    with pytest.raises(ValueError):
        histogram.labels()


def test_a_name_already_registered_is_refused() -> None:
    registry = CollectorRegistry()
    LoopCounter("x_requests", "Help.", ["outcome"], registry)
    with pytest.raises(ValueError):
        Counter("x_requests", "Help.", ["outcome"], registry=registry)


def _frames_of(call: Callable[[], object]) -> list[str]:
    """The Python frames `call` runs, itself (the lambda) left out."""
    frames: list[str] = []

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event == "call":
            frames.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return [name for name in frames if "<lambda>" not in name]


def test_an_observation_runs_no_python_frame() -> None:
    """A histogram's `observe` is a C call: on the request's path it costs no frame of ours."""
    series = HistogramSeries(BUCKETS)
    assert _frames_of(lambda: series.observe(0.3)) == []
    assert len(series.pending) == 1
    assert series.counts == [0, 0, 0, 1, 0, 0, 0]  # read: folded
    assert len(series.pending) == 0


def test_no_observation_is_lost_to_a_fold_in_another_thread() -> None:
    series = HistogramSeries(BUCKETS)
    per_thread, threads = 20_000, 4

    def observe() -> None:
        for _ in range(per_thread):
            series.observe(0.0007)

    workers = [threading.Thread(target=observe) for _ in range(threads)]
    for worker in workers:
        worker.start()
    while any(worker.is_alive() for worker in workers):
        series.fold()
    for worker in workers:
        worker.join()
    assert sum(series.counts) == per_thread * threads
    assert series.counts[1] == per_thread * threads  # le=0.001
    assert series.sum == pytest.approx(0.0007 * per_thread * threads)


async def test_the_app_folds_waiting_observations_without_a_scrape() -> None:
    """Nobody may ever scrape: the observations waiting in a series stay few."""
    family = LoopHistogram("x_seconds", "Help.", ["route"], CollectorRegistry(), BUCKETS)
    series = family.labels("/pay")
    folding = asyncio.create_task(fold_forever([family], interval=0.01))
    try:
        for _ in range(1_000):
            series.observe(1.0)
        await asyncio.sleep(0.1)
        assert len(series.pending) == 0
    finally:
        folding.cancel()
    assert series.counts[3] == 1_000  # le=1


async def test_a_value_that_is_no_number_stops_no_fold(caplog: pytest.LogCaptureFixture) -> None:
    """A bug that observes something else loses that batch, logged, and folding goes on: a
    stopped fold would let every later observation pile up."""
    family = LoopHistogram("x_seconds", "Help.", [], CollectorRegistry(), BUCKETS)
    series = family.labels()
    folding = asyncio.create_task(fold_forever([family], interval=0.01))
    try:
        series.observe(None)  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        series.observe(1.0)
        await asyncio.sleep(0.05)
        assert not series.pending and not folding.done()
    finally:
        folding.cancel()
    assert series.counts[3] == 1
    assert "observations not numbers dropped" in caplog.text


async def test_a_counters_add_runs_no_python_frame_and_is_folded_without_a_scrape() -> None:
    """The request path counts with `add` (a C call); the amounts reach the value when it is
    read, and the app's fold takes them when nobody reads it."""
    family = LoopCounter("x_requests", "Help.", ["outcome"], CollectorRegistry())
    series = family.labels("new")
    assert _frames_of(lambda: series.add(1)) == []
    assert series.value == 1
    folding = asyncio.create_task(fold_forever([family], interval=0.01))
    try:
        for _ in range(1_000):
            series.add(1)
        series.inc(2.5)
        await asyncio.sleep(0.1)
        assert len(series.pending) == 0
    finally:
        folding.cancel()
    assert series.value == 1_003.5
