"""bench/profiling.py: the per-request time split read from the proxy's own metrics."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # its modules import each other by name, as bench/ runs them
profiling = importlib.import_module("profiling")


def test_requests_are_counted_whatever_other_labels_their_series_carry() -> None:
    """The request counter carries the answer's status class and source (SPEC §13): a split
    that matched the outcome label alone found no requests and left its table empty."""
    before = {
        'idemproxy_requests_total{outcome="new",source="upstream",status_class="2xx"}': 10.0,
        'idemproxy_store_seconds_sum{operation="claim"}': 1.0,
        'idemproxy_store_seconds_count{operation="claim"}': 10.0,
    }
    after = {
        'idemproxy_requests_total{outcome="new",source="upstream",status_class="2xx"}': 90.0,
        'idemproxy_requests_total{outcome="new",source="upstream",status_class="5xx"}': 20.0,
        'idemproxy_requests_total{outcome="replayed",source="upstream",status_class="2xx"}': 0.0,
        'idemproxy_store_seconds_sum{operation="claim"}': 1.2,
        'idemproxy_store_seconds_count{operation="claim"}': 110.0,
    }
    split = profiling.time_split(before, after)
    assert split is not None
    assert split.requests == 100
    assert split.outcomes == {"new": 100}
    assert round(split.store_ms["claim"], 6) == 2.0
    assert split.store_calls == 1.0
