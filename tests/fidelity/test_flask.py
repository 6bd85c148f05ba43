"""Flask under gunicorn: absolute URLs from `url_for(..., _external=True)`, which takes the
host from the request's Host (as `request.host_url` and every redirect do), behind the proxy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fidelity.drive import Twins, passed_through, three_ways, twins
from tests.fidelity.servers import Running, gunicorn, proxy
from tests.fidelity.wire import request

HOST = "shop.example.com"


@pytest.fixture(scope="module")
def flask(logs: Path) -> Iterator[Twins]:
    with twins("flask", gunicorn("tests.fidelity.apps.flask_orders:app"), logs) as running:
        yield running


@pytest.fixture(scope="module")
def front(flask: Twins, proxy_store: str, logs: Path) -> Iterator[Running]:
    with proxy(flask.behind.url, proxy_store, logs) as running:
        yield running


def test_a_create_names_the_clients_host_and_executes_once(
    flask: Twins, front: Running, key: str
) -> None:
    fields = [("Idempotency-Key", key), ("Content-Type", "application/json")]
    data = request("POST", "/orders", HOST, fields, b'{"amount": 7}')
    driven = three_ways(flask.direct.port, front.port, data, method="POST")
    assert driven.direct.status == 201, driven.direct.describe()
    assert driven.first.value("Location") == f"http://{HOST}/orders/{key}"
    assert flask.direct_ledger.count(key) == 1
    assert flask.behind_ledger.count(key) == 1


def test_a_host_with_a_port_is_named_with_its_port(flask: Twins, front: Running) -> None:
    """The client's Host exactly, port included: the URL a browser can follow back."""
    data = request("GET", "/orders/o-2", f"{HOST}:8443")
    answer = passed_through(flask.direct.port, front.port, data)
    assert json.loads(answer.body)["url"] == f"http://{HOST}:8443/orders/o-2"
