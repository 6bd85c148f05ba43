"""One admin endpoint for several workers (`server.workers` > 1).

Worker 0 serves the configured admin address; every other worker serves its admin app on a
loopback socket the supervisor bound for it. Worker 0 answers for all of them:
  /readyz   ready only when it is and every other worker's /readyz answers 200;
  /metrics  every worker's series, each with a `worker="i"` label, fetched at scrape time, plus
            `idemproxy_worker_up{worker="i"}` (0 when a worker did not answer in time).
Store-wide gauges (the same value read from the one store by every worker) are reported once,
from worker 0, without the label: summing them over workers would count each job N times.

prometheus_client's multiprocess mode was not used: it does not support gauges computed at
scrape time (`set_function`, the waiters gauge) and needs a shared directory on disk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from idemproxy.constants import METRIC_PREFIX

# Worker-to-worker on loopback: a worker slower than this is reported down (or not ready)
# rather than making the probe or the scrape time out as a whole.
PEER_TIMEOUT_SECONDS = 0.8
WORKER_LABEL = "worker"
STORE_WIDE_METRICS = frozenset({f"{METRIC_PREFIX}_unknown_jobs"})


class Peers:
    """The admin apps of workers 1..N-1, as seen from worker 0."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = tuple(urls)
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_SECONDS)
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def first_not_ready(self) -> int | None:
        """The index of the first worker whose /readyz is not 200, or None when all are ready."""
        statuses = await asyncio.gather(*(self._status(url + "/readyz") for url in self.urls))
        for index, status in enumerate(statuses, start=1):
            if status != 200:
                return index
        return None

    async def metrics_texts(self) -> list[str | None]:
        """Each other worker's /metrics text, None for one that did not answer in time."""
        return list(await asyncio.gather(*(self._text(url + "/metrics") for url in self.urls)))

    async def _status(self, url: str) -> int | None:
        try:
            async with self._client().get(url) as response:
                await response.read()
                return response.status
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def _text(self, url: str) -> str | None:
        try:
            async with self._client().get(url) as response:
                if response.status != 200:
                    return None
                return await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None

    def _client(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Peers.open() first"
        return self._session


class _Snapshot(Collector):
    """Already merged families, for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_metrics(texts: Sequence[str | None]) -> bytes:
    """Worker i's exposition is `texts[i]` (None: it did not answer); one exposition out."""
    merged: dict[str, Metric] = {}
    up = GaugeMetricFamily(
        f"{METRIC_PREFIX}_worker_up",
        "1 when the worker answered this scrape, 0 when it did not.",
        labels=[WORKER_LABEL],
    )
    for index, text in enumerate(texts):
        up.add_metric([str(index)], 0.0 if text is None else 1.0)
        if text is not None:
            _add_worker(merged, index, text)
    return generate_latest(_Snapshot([*merged.values(), up]))


def _add_worker(merged: dict[str, Metric], index: int, text: str) -> None:
    for family in text_string_to_metric_families(text):
        if family.name in STORE_WIDE_METRICS:
            if index != 0:
                continue
            samples = list(family.samples)
        else:
            worker = {WORKER_LABEL: str(index)}
            samples = [s._replace(labels={**s.labels, **worker}) for s in family.samples]
        target = merged.get(family.name)
        if target is None:
            target = merged[family.name] = Metric(
                family.name, family.documentation, family.type, family.unit
            )
        target.samples.extend(samples)
