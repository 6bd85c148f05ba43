"""The series an operator graphs (SPEC §13): process and build info, request duration by route,
upstream duration by upstream, HELP texts for operators."""

from __future__ import annotations

import json
import platform
import re
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

import idemproxy
from idemproxy.admin.app import Readiness, create_admin_app
from idemproxy.admin.peers import merge_metrics
from idemproxy.config.settings import load_settings
from idemproxy.observe.metrics import Metrics, watch_redis
from idemproxy.proxy.app import create_app
from idemproxy.store.factory import create_store
from tests.support.backend import Ledger, backend_app
from tests.support.ports import free_port

Client = TestClient[web.Request, web.Application]
DOCS = Path(__file__).resolve().parents[2] / "docs"
DASHBOARD = DOCS.parent / "helm" / "idemproxy" / "dashboards" / "idemproxy.json"
_METRIC_NAME = re.compile(r"\b(?:idemproxy|process|python)_[a-z_]+\b")
_PROMQL_BLOCK = re.compile(r"```promql\n(.*?)```", re.DOTALL)


@pytest.fixture
async def scraped(sqlite_dsn: str) -> AsyncIterator[str]:
    """The admin listener's /metrics after requests on two routes, one unrouted, and an
    upstream that refuses connections."""
    async with TestServer(backend_app(Ledger())) as backend:
        origin = str(backend.make_url("")).rstrip("/")
        down = f"http://127.0.0.1:{free_port()}"
        settings = load_settings(
            store=sqlite_dsn,
            routes=[
                {"prefix": "/pay", "upstream": origin + "/base"},
                {"prefix": "/down", "upstream": down},
            ],
        )
        metrics = Metrics()
        # The series a proxy with `redis.url` adds (its Redis: tests/redis/test_redis_faults.py).
        watch_redis(metrics, SimpleNamespace(up=True, pending_drops=0))
        store = create_store(sqlite_dsn)
        await store.open()
        await store.migrate()
        proxy = TestClient(TestServer(create_app(settings, store=store, metrics=metrics)))
        admin = TestClient(
            TestServer(create_admin_app(settings, store, Readiness(), metrics=metrics))
        )
        async with proxy, admin:
            key = {"Idempotency-Key": "k1"}
            assert (await proxy.post("/pay/1", data=b"a", headers=key)).status == 201
            assert (await proxy.post("/pay/1", data=b"a", headers=key)).status == 201
            assert (await proxy.get("/pay/2?secret=x")).status == 201
            assert (
                await proxy.post("/down", data=b"a", headers={"Idempotency-Key": "k2"})
            ).status == 502
            assert (await proxy.get("/elsewhere/7")).status == 404
            response = await admin.get("/metrics")
            yield await response.text()
        await store.close()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_process_and_python_series_are_there(scraped: str) -> None:
    names = {name for name, _ in _samples(scraped)}
    for name in (
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
        "python_info",
        "python_gc_collections_total",
    ):
        assert name in names, name


def test_build_info_names_the_versions(scraped: str) -> None:
    labels = (
        ("aiohttp", aiohttp.__version__),
        ("python", platform.python_version()),
        ("version", idemproxy.__version__),
    )
    assert _samples(scraped)[("idemproxy_build_info", labels)] == 1


def test_request_duration_is_by_outcome_and_configured_route(scraped: str) -> None:
    counts = {
        labels: value
        for (name, labels), value in _samples(scraped).items()
        if name == "idemproxy_request_duration_seconds_count"
    }
    upstream_2xx = (("source", "upstream"), ("status_class", "2xx"))
    assert counts == {
        (("outcome", "new"), ("route", "/pay"), *upstream_2xx): 1,
        (("outcome", "replayed"), ("route", "/pay"), *upstream_2xx): 1,
        (("outcome", "passthrough"), ("route", "/pay"), *upstream_2xx): 1,
        # The upstream refused the connection: the proxy's own 502 (SPEC §8).
        (("outcome", "new"), ("route", "/down"), ("source", "proxy"), ("status_class", "5xx")): 1,
        (
            ("outcome", "rejected"),
            ("route", "unrouted"),
            ("source", "proxy"),
            ("status_class", "4xx"),
        ): 1,
    }


def test_upstream_duration_is_by_configured_origin(scraped: str) -> None:
    upstreams = {
        dict(labels)["upstream"]
        for (name, labels), _ in _samples(scraped).items()
        if name == "idemproxy_upstream_seconds_count"
    }
    assert len(upstreams) == 2
    assert all(u.startswith("http://127.0.0.1:") and u.count("/") == 2 for u in upstreams)


def test_help_texts_name_no_source_file(scraped: str) -> None:
    helps = [line for line in scraped.splitlines() if line.startswith("# HELP ")]
    assert len(helps) > 30
    assert [line for line in helps if ".py" in line] == []


def _dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"], "a dashboard without panels"
    expressions = []
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        expressions += [target["expr"] for target in panel["targets"]]
    return expressions


def _documented_expressions() -> list[str]:
    blocks = _PROMQL_BLOCK.findall((DOCS / "operations.md").read_text())
    assert blocks, "docs/operations.md shows no PromQL"
    return [line for block in blocks for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("source", [_dashboard_expressions, _documented_expressions])
def test_every_graphed_metric_is_in_the_scrape(scraped: str, source: object) -> None:
    """The Grafana dashboard and the PromQL of docs/operations.md name only series a real
    proxy exposes (a renamed metric would leave a panel empty without a word)."""
    assert callable(source)
    # Worker 0's merged exposition under --workers (admin/peers.py) adds idemproxy_worker_up.
    merged = merge_metrics([scraped, scraped]).decode()
    names = {name for name, _ in _samples(scraped)} | {name for name, _ in _samples(merged)}
    expressions = source()
    named = [name for expression in expressions for name in _METRIC_NAME.findall(expression)]
    assert named
    assert sorted({name for name in named if name not in names}) == []
