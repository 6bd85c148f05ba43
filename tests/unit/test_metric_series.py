"""docs/operations.md, Metrics: the series an alert on a rate reads exist from the start, so a
rate is 0, never "no data" (an alert on `rate(idemproxy_store_errors_total[5m]) > 0` must be
able to tell "no errors" from "no proxy")."""

from __future__ import annotations

from prometheus_client import generate_latest

from idemproxy.observe.metrics import Metrics


def test_the_store_errors_of_every_request_s_operations_exist_at_zero() -> None:
    text = generate_latest(Metrics().registry).decode()
    for operation in ("claim", "get_job", "complete", "renew_lease"):
        assert f'idemproxy_store_errors_total{{operation="{operation}"}} 0.0' in text, operation


def test_the_request_resolution_and_quota_counters_exist_at_zero() -> None:
    text = generate_latest(Metrics().registry).decode()
    assert 'idemproxy_quota_refusals_total{limit="stored_bytes"} 0.0' in text
    assert 'idemproxy_resolutions_total{result="lost",way="reconcile"} 0.0' in text
