"""Worker 0's /metrics: every worker's series, labelled; store-wide gauges once (admin/peers.py)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from idemproxy.admin.peers import merge_metrics
from idemproxy.observe.metrics import Metrics


def _exposition(new: int, unknown: int, claim_seconds: float) -> str:
    metrics = Metrics()
    metrics.requests.labels("new", "2xx", "upstream").inc(new)
    metrics.unknown_jobs.set(unknown)
    metrics.store_seconds.labels("claim").observe(claim_seconds)
    return generate_latest(metrics.registry).decode()


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_each_worker_series_gets_its_worker_label() -> None:
    merged = _samples(merge_metrics([_exposition(3, 5, 0.002), _exposition(4, 5, 0.2), None]))
    new = (("outcome", "new"), ("source", "upstream"), ("status_class", "2xx"))
    assert merged[("idemproxy_requests_total", (*new, ("worker", "0")))] == 3
    assert merged[("idemproxy_requests_total", (*new, ("worker", "1")))] == 4
    # Histograms keep their buckets, per worker.
    bucket = "idemproxy_store_seconds_bucket"
    assert merged[(bucket, (("le", "0.005"), ("operation", "claim"), ("worker", "0")))] == 1
    assert merged[(bucket, (("le", "0.005"), ("operation", "claim"), ("worker", "1")))] == 0
    # One store, one value: not multiplied by the number of workers.
    assert [v for (name, _), v in merged.items() if name == "idemproxy_unknown_jobs"] == [5]
    up = {labels: v for (name, labels), v in merged.items() if name == "idemproxy_worker_up"}
    assert up == {(("worker", "0"),): 1, (("worker", "1"),): 1, (("worker", "2"),): 0}


def test_a_family_is_written_once_with_all_its_samples() -> None:
    text = merge_metrics([_exposition(1, 0, 0.1), _exposition(2, 0, 0.1)]).decode()
    assert text.count("# TYPE idemproxy_requests_total counter") == 1
    lines = text.splitlines()
    first = lines.index("# TYPE idemproxy_requests_total counter")
    block = lines[first + 1 : first + 1 + 18]
    assert all(line.startswith("idemproxy_requests_total{") for line in block)
