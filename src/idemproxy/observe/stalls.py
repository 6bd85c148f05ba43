"""What holds the event loop: how late its timers run, and the cyclic collector's pauses.

A proxy process serves every request on one event loop (docs/operations.md, "Several workers
on one host"): whatever holds that loop (a CPU-bound burst, a collection, a blocking call)
delays every request in flight at once, and the request histograms only show it spread over
all of them. Two histograms show it where it happens:

* `idemproxy_event_loop_lag_seconds`: a timer set every `LAG_INTERVAL_SECONDS`, how late the
  loop ran it. Near 0 on a loop that keeps up; a stall shows as a late timer whatever held it.
* `idemproxy_gc_pause_seconds{generation}`: the duration of every collection of the cyclic
  garbage collector, in whichever thread it ran (it holds the interpreter for all of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from idemproxy.observe.series import HistogramSeries, LoopHistogram

# Ten timers a second: a stall of 100 ms or more always delays one; each costs the loop a few
# microseconds.
LAG_INTERVAL_SECONDS = 0.1
STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
GC_GENERATIONS = 3  # gc.get_count()


async def measure_loop_lag(lag: HistogramSeries, interval: float = LAG_INTERVAL_SECONDS) -> None:
    """Observe, until cancelled, how late the loop runs a timer due every `interval` seconds."""
    loop = asyncio.get_running_loop()
    observe = lag.observe
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - due))


class CollectorPauses:
    """A `gc.callbacks` hook observing each collection's duration by generation.

    A collection may run in any thread (the log writer's, the SQLite worker's), but never two
    at once, and an allocation during one starts none: the hook is the series' only writer,
    one call at a time, so the series need no lock (a lock taken here could be the one a
    scrape holds in the thread the collection interrupted)."""

    def __init__(self, pauses: LoopHistogram) -> None:
        self._by_generation = [pauses.labels(str(g)) for g in range(GC_GENERATIONS)]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)
