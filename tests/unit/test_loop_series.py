"""The request path's counters and histograms (observe/series.py) expose exactly what
prometheus_client's own would for the same observations (SPEC §13): dashboards, alerts and the
workers' merge (admin/peers.py) read the same text."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from idemproxy.observe.series import LoopCounter, LoopHistogram

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
