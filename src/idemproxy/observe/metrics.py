"""Prometheus metrics (SPEC §13), on a registry of their own that the admin listener serves:
the request path's series (kept by the event loop), what holds the loop (its lag, the
collector's pauses), and the families and children the proxy observes.

Every label value is a member of one of the enums below (`RequestOutcome`, ...), so that a
misspelt one fails the type check instead of starting a new series.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import platform
import time
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from idemproxy import __version__
from idemproxy.constants import METRIC_PREFIX
from idemproxy.errors import StoreUnavailable
from idemproxy.observe.logs import dropped_log_lines
from idemproxy.store.cache.memory import MemoryReplayCache
from idemproxy.store.factory import redis_layer
from idemproxy.store.layers import StoreStack
from idemproxy.store.ports import Operators

if TYPE_CHECKING:
    from idemproxy.config.settings import Settings


# What holds the event loop: how late its timers run, and the cyclic collector's pauses.
#
# A proxy process serves every request on one event loop (docs/operations.md, "Several workers
# on one host"): whatever holds that loop (a CPU-bound burst, a collection, a blocking call)
# delays every request in flight at once, and the request histograms only show it spread over
# all of them. Two histograms show it where it happens:
#
# * `idemproxy_event_loop_lag_seconds`: a timer set every `LAG_INTERVAL_SECONDS`, how late the
#   loop ran it. Near 0 on a loop that keeps up; a stall shows as a late timer whatever held it.
# * `idemproxy_gc_pause_seconds{generation}`: the duration of every collection of the cyclic
#   garbage collector, in whichever thread it ran (it holds the interpreter for all of them).


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


def _taken(pending: list[float]) -> list[float]:
    """What a series' list holds now, taken out of it: an append from another thread meanwhile
    (the collector's hook) stays for the next fold."""
    taken = len(pending)
    values = pending[:taken]
    del pending[:taken]
    return values


class CounterSeries:
    """One labelled counter: `inc` as prometheus_client's (never negative).

    `add` is the list's own `append`, as a histogram's `observe`: the request path counts with
    one C call and no frame of ours (bench/calls.py), a non-negative amount it chooses itself.
    The amounts are summed into the value when it is read (`value`, a scrape) and by `fold`."""

    __slots__ = ("_value", "add", "created", "pending")

    def __init__(self) -> None:
        self._value = 0.0
        self.created = time.time()
        self.pending: list[float] = []  # added, not yet in the value
        self.add: Callable[[float], None] = self.pending.append

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.pending.append(amount)

    def fold(self) -> None:
        amounts = _taken(self.pending)
        total = self._value
        for amount in amounts:
            total += amount  # in order, as prometheus_client's value
        self._value = total

    @property
    def value(self) -> float:
        self.fold()
        return self._value


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

    __slots__ = ("_counts", "_sum", "bounds", "created", "observe", "pending")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self.created = time.time()
        self.pending: list[float] = []  # observed, not yet in the buckets
        self.observe: Callable[[float], None] = self.pending.append

    def fold(self) -> None:
        values = _taken(self.pending)
        counts, bounds, total = self._counts, self.bounds, self._sum
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            total += value  # in order, as prometheus_client's sum
        self._sum = total

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
            if series.pending:  # a test in place: most series have nothing waiting
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


# Folded this often, the observations waiting in a busy process's series stay in the tens of
# thousands (a few MB at most).
FOLD_INTERVAL_SECONDS = 1.0


async def fold_forever(
    families: Sequence[LoopCounter | LoopHistogram], interval: float = FOLD_INTERVAL_SECONDS
) -> None:
    """Sort the histograms' waiting observations into their buckets and add the counters'
    waiting amounts to their values, until cancelled. One loop over every series, a series
    with nothing waiting tested in place: a fold that comes during a request adds only the
    folds of the series that request observed to its calls."""
    while True:
        await asyncio.sleep(interval)
        for family in families:
            waiting: list[CounterSeries | HistogramSeries] = list(family._series.values())
            for series in waiting:
                if series.pending:
                    try:
                        series.fold()
                    except Exception:  # a value that is no number: its batch is dropped
                        log.exception("%s: observations not numbers dropped", family.name)


log = logging.getLogger("idemproxy.metrics")
C = TypeVar("C")  # a child: a prometheus_client metric's, or one of the series above
L = TypeVar("L", bound=str)  # a label value: one of the enums below, or a store operation
K = TypeVar("K", bound=Hashable)  # a child's key: a label value, or a tuple of them
# How often the unknown-jobs gauge is refreshed at most (one cheap COUNT on the store).
_GAUGE_REFRESH_SECONDS = 15.0
# The `route` label of a request that matched no route: with the configured prefixes, the
# label's whole set of values (never a raw path: one series per client-chosen URL).
UNROUTED = "unrouted"


# The store operations every governed request may make (store/ports.py `JobStore`).
_HOT_OPERATIONS = ("claim", "get_job", "complete", "renew_lease")


class RequestOutcome(enum.StrEnum):
    """`idemproxy_requests_total{outcome}`: exactly one per request."""

    NEW = "new"  # this request's attempt ran (first of its key, or retry of a released job)
    REPLAYED = "replayed"  # answered at once from the stored response
    HELD = "held"  # waited for a duplicate in flight, then answered from its stored response
    MISMATCH = "mismatch"  # the key was used with another payload (409/422)
    # A duplicate in flight past max_wait, or at once in the ietf profile (409).
    IN_FLIGHT_CONFLICT = "in_flight_conflict"
    UNKNOWN = "unknown"  # the key's outcome is unknown (409 outcome-unknown)
    PASSTHROUGH = "passthrough"  # not governed: no key, or a method that is not governed
    REJECTED = "rejected"  # refused before any storage call (bad key, no owner, body too large)
    # The store (or the waiter limit, a shutdown, the identity provider's keys) could not take it.
    UNAVAILABLE = "unavailable"
    STATUS_LOOKUP = "status_lookup"  # a status lookup, answered by the proxy (SPEC §7.1)


class AttemptOutcome(enum.StrEnum):
    """`idemproxy_attempts_total{outcome}`."""

    SUCCEEDED = "succeeded"  # completed the job
    FAILED = "failed"  # released the job: nothing executed
    UNKNOWN = "unknown"  # the upstream may have executed it
    DISCARDED = "discarded"  # a result that lost the completion CAS


class UpstreamOutcome(enum.StrEnum):
    """`idemproxy_upstream_seconds{outcome}`: how an upstream call ended."""

    ANSWERED = "answered"  # with the attempt's answer
    FAILED = "failed"  # with a response that fails the attempt (its status, its contract)
    # With no response, by what the transport failure does to the job (core.decision.Outcome).
    RELEASE = "release"
    UNKNOWN = "unknown"


class UnsentOutcome(enum.StrEnum):
    """`idemproxy_unsent_claims_total{outcome}`: what became of a claim that failed at the proxy
    (proxy/background/unsent.py)."""

    RELEASED = "released"  # it committed after all, untouched: released
    NOT_COMMITTED = "not_committed"  # it never appeared within its lease
    MOVED_ON = "moved_on"  # another job holds the key, or this one moved on
    DROPPED = "dropped"  # one more than the process holds
    # The store refused the write for its data (StoreRefused): final
    # (proxy/background/followups.py).
    REFUSED = "refused"


class UnwrittenOutcome(enum.StrEnum):
    """`idemproxy_unwritten_outcomes_total{outcome}`: what became of an attempt's outcome that
    the store could not take (proxy/background/unwritten.py)."""

    WRITTEN = "written"
    MOVED_ON = "moved_on"  # the job moved on meanwhile: nothing written
    DROPPED = "dropped"  # one more than the process holds
    REFUSED = "refused"  # the store refused the write for its data: final


class KeyFetchResult(enum.StrEnum):
    """`idemproxy_identity_provider_fetches_total{result}`: how a fetch of the identity
    provider's keys ended (proxy/idp/keys.py)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"  # the keys fetched before stay in use


class DisconnectStage(enum.StrEnum):
    """`idemproxy_client_disconnects_total{stage}`: where a client hung up
    (proxy/server/hangups.py)."""

    REQUEST_BODY = "request_body"
    RESPONSE = "response"


# Rows per group-committed statement, up to pool.store_batch's bound.
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1000)
# Sub-millisecond store calls up to the default upstream timeout's range; request and upstream
# histograms reach further when an upstream may take longer (`latency_buckets`).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)
# Beyond a minute, for routes whose upstream timeout is longer (an LLM's 300 s).
_LONG_BUCKETS = (120.0, 300.0, 600.0, 1800.0, 3600.0)


def latency_buckets(longest_upstream_timeout: float) -> tuple[float, ...]:
    """The default buckets of the request and upstream histograms: up to the longest upstream
    timeout, so that a slow route's p99 is a bucket's bound rather than +Inf."""
    if longest_upstream_timeout <= LATENCY_BUCKETS[-1]:
        return LATENCY_BUCKETS
    longer = tuple(bound for bound in _LONG_BUCKETS if bound < longest_upstream_timeout)
    return (*LATENCY_BUCKETS, *longer, longest_upstream_timeout)


class Source(enum.StrEnum):
    """`source` of the request series: who produced the status the client got."""

    UPSTREAM = "upstream"  # the upstream's answer, first or replayed from the store
    PROXY = "proxy"  # the proxy's own (a problem document, a status lookup)


# `status_class` values: an answer's status by its first digit (RFC 9110 §15).
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
# (outcome, status_class, source): the key of a request series.
RequestKey = tuple[RequestOutcome, str, Source]
# The series each outcome usually has, made at start so that its rate is 0, never "no data";
# an upstream's 5xx too, the numerator of an error-rate objective.
_USUAL_ANSWERS: dict[RequestOutcome, tuple[tuple[str, Source], ...]] = {
    RequestOutcome.NEW: (("2xx", Source.UPSTREAM), ("5xx", Source.UPSTREAM)),
    RequestOutcome.REPLAYED: (("2xx", Source.UPSTREAM),),
    RequestOutcome.HELD: (("2xx", Source.UPSTREAM),),
    RequestOutcome.MISMATCH: (("4xx", Source.PROXY),),
    RequestOutcome.IN_FLIGHT_CONFLICT: (("4xx", Source.PROXY),),
    RequestOutcome.UNKNOWN: (("4xx", Source.PROXY),),
    RequestOutcome.PASSTHROUGH: (("2xx", Source.UPSTREAM), ("5xx", Source.UPSTREAM)),
    RequestOutcome.REJECTED: (("4xx", Source.PROXY),),
    RequestOutcome.UNAVAILABLE: (("5xx", Source.PROXY),),
    RequestOutcome.STATUS_LOOKUP: (("2xx", Source.PROXY),),
}


class Children(dict[K, C]):
    """A metric's children by label value, bound once: `labels()` takes a lock, builds a tuple
    and looks it up on every call, which the hot path pays several times per request.

    A value not seen yet is bound on first use, so the exposition only gains a series when it
    is first observed, exactly as with `labels()`.
    """

    def __init__(self, bind: Callable[[K], C], values: Iterable[K] = ()) -> None:
        super().__init__()
        self._bind: Callable[[K], C] = bind
        for value in values:
            self[value] = bind(value)

    def __missing__(self, value: K) -> C:
        child: C = self._bind(value)
        self[value] = child
        return child


class ByOutcome(dict[str, Children[L, HistogramSeries]]):
    """A histogram labelled `outcome` and one other label: its children by that label's value
    (a route prefix, an upstream origin), then by outcome, each bound on first use."""

    def __init__(self, histogram: LoopHistogram) -> None:
        super().__init__()
        self._histogram = histogram

    def __missing__(self, value: str) -> Children[L, HistogramSeries]:
        histogram = self._histogram
        children = Children[L, HistogramSeries](lambda outcome: histogram.labels(outcome, value))
        self[value] = children
        return children


class ByRoute(dict[str, Children[RequestKey, HistogramSeries]]):
    """The request histogram's children by route prefix, then by request key."""

    def __init__(self, histogram: LoopHistogram) -> None:
        super().__init__()
        self._histogram = histogram

    def __missing__(self, route: str) -> Children[RequestKey, HistogramSeries]:
        histogram = self._histogram
        children = Children[RequestKey, HistogramSeries](
            lambda key: histogram.labels(key[0], route, key[1], key[2])
        )
        self[route] = children
        return children


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> None:
        """`buckets`: the request and upstream histograms' (`metrics.buckets`, or
        `latency_buckets` of the longest upstream timeout)."""
        self.registry = registry or CollectorRegistry()
        # The request path's series are the loop's own; the rest are
        # prometheus_client's.
        self.requests = LoopCounter(
            f"{METRIC_PREFIX}_requests",
            "Requests by outcome, by the class of the status answered and by who produced it "
            "(upstream or proxy).",
            ["outcome", "status_class", "source"],
            self.registry,
        )
        self.attempts = LoopCounter(
            f"{METRIC_PREFIX}_attempts", "Attempts by outcome.", ["outcome"], self.registry
        )
        self.response_buffer_overdrafts = self._counter(
            "response_buffer_overdrafts",
            "Response bodies taken over limits.response_buffer after waiting "
            "limits.response_buffer_wait for room.",
            [],
        )
        self.identity_provider_fetches = self._counter(
            "identity_provider_fetches",
            "Fetches of the JWT owner keys from the identity provider, by result.",
            ["result"],
        )
        self.late_results = self._counter(
            "late_results_discarded", "Attempt results that lost the completion CAS.", []
        )
        self.unsent_claims = self._counter(
            "unsent_claims",
            "Claims that failed at the proxy (503, nothing forwarded), by what became of them.",
            ["outcome"],
        )
        self.unwritten_outcomes = self._counter(
            "unwritten_outcomes",
            "Attempt outcomes the store could not take (503 after forwarding), by what became "
            "of them.",
            ["outcome"],
        )
        self.second_responses = self._counter(
            "second_responses_refused",
            "Responses returned after another had started on the same request, not written: "
            "the connection was closed instead. Always a bug.",
            [],
        )
        self.orphans_taken_over = self._counter(
            "orphans_taken_over",
            "Jobs in flight whose lease ran out (their proxy died) that this process took over "
            "as unknown, in the background or when a retry of the job's key found it.",
            [],
        )
        self.resolutions = self._counter(
            "resolutions",
            "Questions about unknown jobs (SPEC §3.6), by way (reconcile, upstream_key) and "
            "result: completed, released, unknown (the answer proved nothing) or lost (the job "
            "was resolved otherwise meanwhile, by an operator or another replica).",
            ["way", "result"],
        )
        for way in ("reconcile", "upstream_key"):  # core/resolution.py `Way`
            for result in ("completed", "released", "unknown", "lost"):
                self.resolutions.labels(way, result)  # every series from the start
        self.client_disconnects = self._counter(
            "client_disconnects",
            "Clients that hung up mid-request, by stage: request_body (before it was complete; "
            "never claimed) or response (during a pass-through response).",
            ["stage"],
        )
        self.upstream_headers_dropped = self._counter(
            "upstream_headers_dropped",
            "Upstream response header fields left out for a control character in their value "
            "(SPEC §10).",
            [],
        )
        self.quota_refusals = self._counter(
            "quota_refusals",
            "New jobs refused because their owner was over a quota (SPEC §9), by limit.",
            ["limit"],
        )
        for limit in ("in_flight", "new_per_second", "stored_bytes"):  # core/quota.py
            self.quota_refusals.labels(limit)  # every series from the start
        self.store_errors = self._counter(
            "store_errors", "Store calls that failed (the store was unavailable).", ["operation"]
        )
        self.upstream_seconds = LoopHistogram(
            f"{METRIC_PREFIX}_upstream_seconds",
            "Upstream call duration of governed attempts, from sending the request until the "
            "answer arrived whole, by outcome and upstream (the configured URL's origin).",
            ["outcome", "upstream"],
            self.registry,
            buckets,
        )
        self.request_seconds = LoopHistogram(
            f"{METRIC_PREFIX}_request_duration_seconds",
            "Time from the request head to the proxy's answer, upstream included, by outcome, "
            "route (the configured prefix, or unrouted), status class and source.",
            ["outcome", "route", "status_class", "source"],
            self.registry,
            buckets,
        )
        self.build_info = Gauge(
            f"{METRIC_PREFIX}_build_info",
            "Always 1; the labels say which idemproxy, Python and aiohttp this process runs.",
            ["version", "python", "aiohttp"],
            registry=self.registry,
        )
        self.build_info.labels(__version__, platform.python_version(), aiohttp.__version__).set(1)
        self.store_seconds = LoopHistogram(
            f"{METRIC_PREFIX}_store_seconds",
            "Store call duration by operation.",
            ["operation"],
            self.registry,
            LATENCY_BUCKETS,
        )
        # Group commit (store/batching.py): rows per batched statement, by its kind (claim,
        # complete). Mostly 1 when idle; under load it grows with the requests that queued
        # while the previous statement was in flight, up to `pool.store_batch`.
        self.store_batch_rows = LoopHistogram(
            f"{METRIC_PREFIX}_store_batch_rows",
            "Rows per group-committed store statement (one transaction, one commit), by kind.",
            ["kind"],
            self.registry,
            _BATCH_BUCKETS,
        )
        # What held the event loop, and the collector's share of it.
        event_loop_lag = LoopHistogram(
            f"{METRIC_PREFIX}_event_loop_lag_seconds",
            f"How late the event loop ran a timer due every {LAG_INTERVAL_SECONDS:g} s: how "
            "long something held it (every request in flight waited that long).",
            [],
            self.registry,
            STALL_BUCKETS,
        )
        self.event_loop_lag = event_loop_lag.labels()
        self.gc_pauses = LoopHistogram(
            f"{METRIC_PREFIX}_gc_pause_seconds",
            "Duration of each collection of the cyclic garbage collector, by generation: the "
            "process runs no Python meanwhile.",
            ["generation"],
            self.registry,
            STALL_BUCKETS,
        )
        for generation in range(GC_GENERATIONS):  # every series from the start
            self.gc_pauses.labels(str(generation))
        # What `fold_forever` folds.
        self.folded = (
            self.requests,
            self.attempts,
            self.upstream_seconds,
            self.request_seconds,
            self.store_seconds,
            self.store_batch_rows,
            event_loop_lag,
            self.gc_pauses,
        )
        self.waiters = Gauge(
            f"{METRIC_PREFIX}_waiters",
            "Duplicates held right now, waiting for a job in flight.",
            registry=self.registry,
        )
        self.response_buffer = Gauge(
            f"{METRIC_PREFIX}_response_buffer_bytes",
            "Response bytes held in memory right now, against limits.response_buffer.",
            registry=self.registry,
        )
        self.replay_bodies = Gauge(
            f"{METRIC_PREFIX}_replay_body_bytes",
            "Bytes of large stored bodies being replayed right now (one copy per job).",
            registry=self.registry,
        )
        self.client_connections = Gauge(
            f"{METRIC_PREFIX}_client_connections",
            "Client connections open right now, against limits.max_connections.",
            registry=self.registry,
        )
        self.unknown_jobs = Gauge(
            f"{METRIC_PREFIX}_unknown_jobs",
            "Jobs in state unknown, waiting for an operator.",
            registry=self.registry,
        )
        self.registry.register(_LogDropsCollector())
        # process_* (memory, CPU, file descriptors, start time) and python_* (version, garbage
        # collections) of this process; with several workers each one's are its own, labelled
        # with its worker (admin/peers.py).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        # The hot path's children, bound once. Request, attempt, unsent-claim,
        # unwritten-outcome and key-fetch outcomes: every series exists from the start; the
        # others appear when first observed.
        self.request_answer = Children[RequestKey, CounterSeries](
            lambda key: self.requests.labels(*key),
            [
                (outcome, *answer)
                for outcome, answers in _USUAL_ANSWERS.items()
                for answer in answers
            ],
        )
        self.attempt_outcome = Children[AttemptOutcome, CounterSeries](
            self.attempts.labels, AttemptOutcome
        )
        self.unsent_outcome = Children[UnsentOutcome, Counter](
            self.unsent_claims.labels, UnsentOutcome
        )
        self.key_fetch_result = Children[KeyFetchResult, Counter](
            self.identity_provider_fetches.labels, KeyFetchResult
        )
        self.unwritten_outcome = Children[UnwrittenOutcome, Counter](
            self.unwritten_outcomes.labels, UnwrittenOutcome
        )
        # By upstream origin, then outcome: the origins are the configured upstreams'.
        self.upstream_call = ByOutcome[UpstreamOutcome](self.upstream_seconds)
        # By route prefix, then request key: the prefix's children are looked up once per request.
        self.request_route = ByRoute(self.request_seconds)
        # The store's operations are its method names (store/base.py), not an enum of ours.
        self._store_seconds = Children[str, HistogramSeries](self.store_seconds.labels)
        # Every request's operations from the start (docs/operations.md: a rate of the errors
        # is 0, never "no data"); the others once first called.
        self._store_errors = Children[str, Counter](self.store_errors.labels, _HOT_OPERATIONS)
        self._store_batch_rows = Children[str, HistogramSeries](
            self.store_batch_rows.labels, ("claim", "complete")
        )
        self.client_disconnect = Children[DisconnectStage, Counter](
            self.client_disconnects.labels, DisconnectStage
        )

    @classmethod
    def for_settings(cls, settings: Settings) -> Metrics:
        """The process's metrics, with the histograms' buckets of `metrics.buckets` or reaching
        the longest upstream timeout."""
        configured = settings.metrics.buckets
        if configured:
            return cls(buckets=tuple(configured))
        return cls(buckets=latency_buckets(settings.longest_upstream_timeout))

    def _counter(self, name: str, help_text: str, labels: list[str]) -> Counter:
        return Counter(f"{METRIC_PREFIX}_{name}", help_text, labels, registry=self.registry)

    def observe_store(self, operation: str, seconds: float, failed: bool) -> None:
        """`Store.observer` itself: it runs for every store call, so no wrapper in between."""
        self._store_seconds[operation].observe(seconds)
        if failed:
            self._store_errors[operation].inc()

    def store_seconds_of(self, operation: str) -> Callable[[float], None]:
        """The `store_seconds` series of `operation`'s own `observe` (an append): a call of
        it that did not fail, timed with no call of ours in between."""
        return self._store_seconds[operation].observe

    def batch_observer(self, kind: str) -> Callable[[int], None]:
        """`GroupCommit.observer` of `kind`: the rows of each of its statements, observed by the
        histogram's own method (no call of ours in between, on every claim and completion)."""
        return self._store_batch_rows[kind].observe


def watch_store(metrics: Metrics, stack: StoreStack) -> None:
    """Store call latency and errors, batch sizes and the waiters gauge, straight from the
    store of record; the in-process replay cache's counts when it is there."""
    store = stack.record
    store.observer = metrics.observe_store
    store.claim_seconds = metrics.store_seconds_of("claim")
    store.complete_seconds = metrics.store_seconds_of("complete")
    for batcher in store.group_commits():
        batcher.observer = metrics.batch_observer(batcher.kind)
    metrics.waiters.set_function(lambda: store.watch.waiting)
    cache = stack.layer(MemoryReplayCache)
    if cache is not None:
        metrics.registry.register(_ReplayCacheCollector(cache))
    redis = redis_layer(stack)
    if redis is not None:
        watch_redis(metrics, redis.cache)


def watch_redis(metrics: Metrics, cache: RedisHealth) -> None:
    """Whether the Redis cache is in use, read at scrape time."""
    metrics.registry.register(_RedisCollector(cache))


class RedisHealth(Protocol):
    """What the Redis cache says of itself (store/redis/client.py `RedisCache`)."""

    @property
    def up(self) -> bool: ...

    @property
    def pending_drops(self) -> int: ...


class _RedisCollector(Collector):
    """Read at scrape time: whether the Redis cache is in use, for an alert that says so
    rather than a falling hit ratio (docs/operations.md, When Redis fails)."""

    def __init__(self, cache: RedisHealth) -> None:
        self._cache = cache

    def collect(self) -> Iterable[Metric]:
        cache = self._cache
        yield GaugeMetricFamily(
            f"{METRIC_PREFIX}_redis_up",
            "1 while Redis answers; 0 from a failed call until one succeeds (served from the "
            "store alone meanwhile).",
            int(cache.up),
        )
        yield GaugeMetricFamily(
            f"{METRIC_PREFIX}_redis_invalidations_pending",
            "Deletes not yet through to Redis; the cache is not read until they are.",
            cache.pending_drops,
        )


class _LogDropsCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(
            f"{METRIC_PREFIX}_log_lines_dropped",
            "Log lines dropped because stderr did not take them fast enough.",
            dropped_log_lines(),
        )


class _ReplayCacheCollector(Collector):
    """Read at scrape time: a hit costs the hot path one integer increment, no metric call."""

    def __init__(self, cache: MemoryReplayCache) -> None:
        self._cache = cache

    def collect(self) -> Iterable[Metric]:
        cache = self._cache
        name = f"{METRIC_PREFIX}_replay_cache"
        yield CounterMetricFamily(
            f"{name}_hits", "Duplicates answered from the in-process replay cache.", cache.hits
        )
        yield GaugeMetricFamily(
            f"{name}_entries", "Completed jobs in the in-process replay cache.", cache.entries
        )
        yield GaugeMetricFamily(
            f"{name}_bytes", "Bytes counted against replay_cache.max_bytes.", cache.size
        )


async def refresh_gauges(metrics: Metrics, store: Operators, interval: float) -> None:
    """Keep the unknown-jobs gauge current (an operator alerts on it, SPEC §3.3)."""
    while True:
        with contextlib.suppress(StoreUnavailable):
            metrics.unknown_jobs.set(await store.count_unknown())
        await asyncio.sleep(min(interval, _GAUGE_REFRESH_SECONDS))


def metrics_handler(metrics: Metrics) -> Handler:
    """`/metrics` in the Prometheus text format (SPEC §13)."""

    async def serve_metrics(_request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return serve_metrics
