"""Reading the proxy's metrics in tests: a series' value summed over the labels not given."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def counted(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (e.g. every status class and
    source of one outcome of `idemproxy_requests_total`)."""
    return sum(
        sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )
