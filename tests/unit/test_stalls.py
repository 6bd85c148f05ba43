"""observe/metrics.py: the event loop's lag and the garbage collector's pauses, as measured."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from idemproxy.config.settings import load_settings
from idemproxy.observe.metrics import (
    STALL_BUCKETS,
    CollectorPauses,
    HistogramSeries,
    LoopHistogram,
    Metrics,
    measure_loop_lag,
)
from idemproxy.proxy.app import create_app


def _count_at_least(series: HistogramSeries, seconds: float) -> int:
    """Observations of at least `seconds` (a bucket bound among STALL_BUCKETS)."""
    first = series.bounds.index(seconds)
    return sum(series.counts[first + 1 :])


async def test_a_loop_held_for_a_while_shows_as_a_late_timer() -> None:
    lag = HistogramSeries(STALL_BUCKETS)
    watcher = asyncio.create_task(measure_loop_lag(lag, interval=0.02))
    try:
        await asyncio.sleep(0.1)
        assert sum(lag.counts) >= 2
        held_before = _count_at_least(lag, 0.25)
        # What a blocking call does to every request in flight.
        time.sleep(0.3)  # noqa: ASYNC251 - the stall under test
        await asyncio.sleep(0.05)
        assert _count_at_least(lag, 0.25) == held_before + 1
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def test_each_collection_is_observed_by_its_generation_while_installed() -> None:
    registry = CollectorRegistry()
    hook = CollectorPauses(LoopHistogram("pauses", "test", ["generation"], registry, STALL_BUCKETS))

    def count(generation: str) -> float:
        return registry.get_sample_value("pauses_count", {"generation": generation}) or 0.0

    with hook.installed():
        assert hook in gc.callbacks
        full = count("2")
        gc.collect()
        assert count("2") == full + 1
        gc.collect(0)
        assert count("0") >= 1
    assert hook not in gc.callbacks
    seen = count("2")
    gc.collect()
    assert count("2") == seen  # removed: nothing observed any more


def test_the_series_exist_before_any_stall() -> None:
    """docs/operations.md, Metrics: every series exists from the start."""
    text = Metrics().registry.get_sample_value
    assert text("idemproxy_event_loop_lag_seconds_count") == 0
    for generation in "012":
        assert text("idemproxy_gc_pause_seconds_count", {"generation": generation}) == 0


async def test_a_running_proxy_measures_both_and_leaves_no_hook_behind(tmp_path: Path) -> None:
    settings = load_settings(
        upstream="http://127.0.0.1:9", store=f"sqlite:///{tmp_path / 'jobs.db'}"
    )
    metrics = Metrics()
    hooks = len(gc.callbacks)
    async with TestClient(TestServer(create_app(settings, metrics=metrics))):
        assert len(gc.callbacks) == hooks + 1
        await asyncio.sleep(0.25)
        sample = metrics.registry.get_sample_value
        assert (sample("idemproxy_event_loop_lag_seconds_count") or 0) >= 1
        full = {"generation": "2"}
        before = sample("idemproxy_gc_pause_seconds_count", full) or 0
        gc.collect()
        assert sample("idemproxy_gc_pause_seconds_count", full) == before + 1
    assert len(gc.callbacks) == hooks
