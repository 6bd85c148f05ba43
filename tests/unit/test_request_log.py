"""The request log line and the metrics' exposition (SPEC §13): cheap to make, same output."""

from __future__ import annotations

import copy
import json
import logging
import sys

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client import generate_latest

from idemproxy.constants import ANONYMOUS_OWNER
from idemproxy.observe.logs import JsonFormatter, PlainFormatter
from idemproxy.observe.metrics import (
    AttemptOutcome,
    Metrics,
    RequestOutcome,
    Source,
    UpstreamOutcome,
    latency_buckets,
)
from idemproxy.proxy.routing import Route
from idemproxy.proxy.server.trace import Trace, record

STOCK_PLAIN = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def _at(created: float) -> logging.LogRecord:
    entry = logging.LogRecord("idemproxy.x", logging.WARNING, __file__, 1, "m %s", ("a",), None)
    entry.created, entry.msecs = created, (created - int(created)) * 1000
    return entry


def test_the_plain_line_is_the_stock_formatters_across_seconds() -> None:
    formatter = PlainFormatter()
    for created in (1_700_000_000.0, 1_700_000_000.999, 1_700_000_001.0005, 1_699_999_999.5):
        assert formatter.format(_at(created)) == STOCK_PLAIN.format(_at(created))


def test_a_plain_line_with_a_traceback_or_stack_is_the_stock_formatters() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        failed = _at(1_700_000_000.5)
        failed.exc_info = sys.exc_info()
    stacked = _at(1_700_000_000.5)
    stacked.stack_info = "Stack (most recent call last):\n  here"
    lines = []
    for entry in (failed, stacked):
        expected = STOCK_PLAIN.format(copy.copy(entry))
        assert PlainFormatter().format(entry) == expected
        lines.append(expected)
    assert lines[0].endswith("ValueError: boom")
    assert lines[1].endswith("  here")


def test_json_time_is_rfc3339_utc_with_milliseconds() -> None:
    formatter = JsonFormatter()
    assert json.loads(formatter.format(_at(1_700_000_000.25)))["time"] == (
        "2023-11-14T22:13:20.250Z"
    )
    assert formatter.formatTime(_at(1_700_000_001.0005)) == "2023-11-14T22:13:21.000Z"
    assert formatter.formatTime(_at(1_699_999_999.999)) == "2023-11-14T22:13:19.999Z"


def test_the_anonymous_owner_prints_whole(captured: pytest.LogCaptureFixture) -> None:
    trace = Trace(outcome=RequestOutcome.NEW, owner=ANONYMOUS_OWNER, job_id="j-1", attempt=1)
    record(Metrics(), trace, 201, log_requests=True)
    [entry] = captured.records
    assert entry.fields["owner"] == "anonymous"  # type: ignore[attr-defined]


def _request(target: str) -> web.BaseRequest:
    return make_mocked_request("POST", target)


def test_the_path_leaves_the_query_string_out(captured: pytest.LogCaptureFixture) -> None:
    trace = Trace(outcome=RequestOutcome.NEW, request=_request("/pay/a%2Fb?token=s3cret&a=1"))
    record(Metrics(), trace, 201, log_requests=True)
    [entry] = captured.records
    assert entry.fields["path"] == "/pay/a%2Fb" and entry.fields["method"] == "POST"  # type: ignore[attr-defined]


def test_log_query_masks_secret_parameters(captured: pytest.LogCaptureFixture) -> None:
    trace = Trace(outcome=RequestOutcome.NEW, request=_request("/pay?token=s3cret&a=1"))
    record(Metrics(), trace, 201, log_requests=True, log_query=True)
    [entry] = captured.records
    assert entry.fields["path"] == "/pay?token=***&a=1"  # type: ignore[attr-defined]


def test_a_session_id_in_a_path_parameter_is_masked(captured: pytest.LogCaptureFixture) -> None:
    """Log lines carry no credential (docs/operations.md, Logs): a session id in the path too."""
    trace = Trace(outcome=RequestOutcome.NEW, request=_request("/pay;jsessionid=S3CRET/x;v=1"))
    record(Metrics(), trace, 201, log_requests=True, log_query=True)
    [entry] = captured.records
    assert entry.fields["path"] == "/pay;jsessionid=***/x;v=1"  # type: ignore[attr-defined]


def test_pass_through_is_logged_with_the_access_log(captured: pytest.LogCaptureFixture) -> None:
    route = Route("/api", None, "http://user:pw@backend:8080/base", False, 60.0)
    trace = Trace(request=make_mocked_request("GET", "/api/balance"), route=route)
    record(Metrics(), trace, 200, log_requests=False, access_log=True)
    [entry] = captured.records
    assert entry.getMessage().startswith(
        "passthrough outcome=passthrough status=200 method=GET path=/api/balance route=/api "
        "upstream=http://backend:8080 ms="
    )


@pytest.fixture
def captured(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="idemproxy.requests")
    return caplog


def test_a_governed_request_logs_one_line_with_its_fields(
    captured: pytest.LogCaptureFixture,
) -> None:
    trace = Trace(outcome=RequestOutcome.NEW, owner="0123456789abcdef", job_id="j-1", attempt=2)
    record(Metrics(), trace, 201, log_requests=True)
    [entry] = captured.records
    fields = entry.fields  # type: ignore[attr-defined]
    assert entry.levelno == logging.INFO and entry.name == "idemproxy.requests"
    assert entry.funcName == "record" and entry.pathname.endswith("trace.py")
    assert entry.getMessage() == (
        f"governed outcome=new status=201 job=j-1 attempt=2 owner=01234567 ms={fields['ms']}"
    )
    assert fields["owner"] == "01234567" and fields["status"] == 201
    line = json.loads(JsonFormatter().format(entry))
    assert line["message"] == entry.getMessage() and line["job"] == "j-1"


def test_fields_without_a_value_are_left_out(captured: pytest.LogCaptureFixture) -> None:
    record(Metrics(), Trace(outcome=RequestOutcome.REJECTED), 400, log_requests=True)
    [entry] = captured.records
    assert entry.getMessage().startswith("governed outcome=rejected status=400 ms=")
    assert set(json.loads(JsonFormatter().format(entry))) == {
        "time",
        "level",
        "logger",
        "message",
        "outcome",
        "status",
        "ms",
    }


def test_pass_through_is_counted_not_logged(captured: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    record(metrics, Trace(), 200, log_requests=True)
    assert captured.records == []
    assert (
        _value(
            metrics,
            "idemproxy_requests_total",
            outcome="passthrough",
            status_class="2xx",
            source="upstream",
        )
        == 1
    )


def _value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.mark.parametrize(
    ("status", "by_proxy", "outcome", "series"),
    [
        (503, True, RequestOutcome.UNAVAILABLE, ("5xx", "proxy")),
        (502, False, RequestOutcome.NEW, ("5xx", "upstream")),
        (302, False, RequestOutcome.PASSTHROUGH, ("3xx", "upstream")),
        (200, False, RequestOutcome.STATUS_LOOKUP, ("2xx", "proxy")),
        (101, False, RequestOutcome.PASSTHROUGH, ("1xx", "upstream")),
        (499, True, RequestOutcome.REJECTED, ("4xx", "proxy")),
        # Outside 100-599 (an upstream may send any three digits): the nearest class.
        (99, False, RequestOutcome.PASSTHROUGH, ("1xx", "upstream")),
        (600, False, RequestOutcome.PASSTHROUGH, ("5xx", "upstream")),
        (999, False, RequestOutcome.PASSTHROUGH, ("5xx", "upstream")),
    ],
)
def test_requests_carry_the_status_class_and_who_answered(
    status: int, by_proxy: bool, outcome: RequestOutcome, series: tuple[str, str]
) -> None:
    metrics = Metrics()
    record(metrics, Trace(outcome=outcome, by_proxy=by_proxy), status, log_requests=False)
    status_class, source = series
    labels = {"outcome": outcome, "status_class": status_class, "source": source}
    assert _value(metrics, "idemproxy_requests_total", **labels) == 1
    assert (
        _value(metrics, "idemproxy_request_duration_seconds_count", route="unrouted", **labels) == 1
    )


def test_buckets_reach_the_longest_upstream_timeout() -> None:
    assert latency_buckets(30.0)[-1] == 60
    assert latency_buckets(300.0)[-3:] == (60, 120.0, 300.0)
    assert latency_buckets(90.0)[-2:] == (60, 90.0)
    metrics = Metrics(buckets=(0.1, 1.0, 300.0))
    record(metrics, Trace(), 200, log_requests=False)
    text = generate_latest(metrics.registry).decode()
    requests = "".join(line for line in text.splitlines() if "_request_duration_" in line)
    assert 'le="300.0"' in requests and 'le="0.005"' not in requests


def test_every_outcome_series_exists_from_the_start_and_no_other() -> None:
    metrics = Metrics()
    text = generate_latest(metrics.registry).decode()
    for outcome in RequestOutcome:
        assert f'idemproxy_requests_total{{outcome="{outcome}",' in text
    assert (
        'idemproxy_requests_total{outcome="unavailable",source="proxy",status_class="5xx"} 0.0'
        in text
    )
    for attempt_outcome in AttemptOutcome:
        assert f'idemproxy_attempts_total{{outcome="{attempt_outcome}"}} 0.0' in text
    assert "idemproxy_store_seconds_count{" not in text
    # The errors of the operations every request makes, at zero (tests/unit/test_metric_series.py);
    # no other operation's until it is first called.
    errors = [
        line for line in text.splitlines() if line.startswith("idemproxy_store_errors_total{")
    ]
    assert len(errors) == 4 and all(line.endswith("} 0.0") for line in errors), errors
    assert "idemproxy_upstream_seconds_count{" not in text


def test_pre_bound_children_move_the_labelled_series() -> None:
    metrics = Metrics()
    metrics.request_answer[RequestOutcome.NEW, "2xx", Source.UPSTREAM].inc()
    metrics.attempt_outcome[AttemptOutcome.DISCARDED].inc()
    metrics.upstream_call["http://pay:8080"][UpstreamOutcome.ANSWERED].observe(0.01)
    metrics.observe_store("claim", 0.002, False)
    metrics.observe_store("claim", 0.003, True)
    assert (
        _value(
            metrics,
            "idemproxy_requests_total",
            outcome="new",
            status_class="2xx",
            source="upstream",
        )
        == 1
    )
    assert _value(metrics, "idemproxy_attempts_total", outcome="discarded") == 1
    assert (
        _value(
            metrics,
            "idemproxy_upstream_seconds_count",
            outcome="answered",
            upstream="http://pay:8080",
        )
        == 1
    )
    assert _value(metrics, "idemproxy_store_seconds_count", operation="claim") == 2
    assert _value(metrics, "idemproxy_store_errors_total", operation="claim") == 1
    assert _value(metrics, "idemproxy_store_errors_total", operation="get") is None
    # A child bound lazily is the one `labels()` gives: one series, not two.
    assert metrics.store_seconds.labels("claim") is metrics._store_seconds["claim"]
