"""Django in production settings (DEBUG off, `ALLOWED_HOSTS = ["api.example.com"]`) under
gunicorn, behind the proxy as a new user puts it: `idemproxy serve --upstream URL`.

Django answers 400 to a Host it does not allow and builds absolute URLs (`Location`) from the
Host it got: the backend must see the client's Host, not the upstream's address.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fidelity.drive import Twins, passed_through, three_ways, twins
from tests.fidelity.servers import Running, gunicorn, proxy
from tests.fidelity.wire import request

HOST = "api.example.com"
APP = "tests.fidelity.apps.django_orders.wsgi:application"


@pytest.fixture(scope="module")
def django(logs: Path) -> Iterator[Twins]:
    with twins("django", gunicorn(APP), logs) as running:
        yield running


@pytest.fixture(scope="module")
def front(django: Twins, proxy_store: str, logs: Path) -> Iterator[Running]:
    with proxy(django.behind.url, proxy_store, logs) as running:
        yield running


def _create(key: str) -> bytes:
    body = json.dumps({"amount": 1250}).encode()
    fields = [("Content-Type", "application/json"), ("Idempotency-Key", key)]
    return request("POST", "/orders", HOST, fields, body)


def test_a_create_is_answered_as_django_answers_it_and_executes_once(
    django: Twins, front: Running, key: str
) -> None:
    driven = three_ways(django.direct.port, front.port, _create(key), method="POST")
    # What the comparison was about: Django accepted the client's Host and named it.
    assert driven.direct.status == 201, driven.direct.describe()
    assert driven.first.value("Location") == f"http://{HOST}/orders/{key}"
    assert json.loads(driven.replay.body)["url"] == f"http://{HOST}/orders/{key}"
    assert django.direct_ledger.count(key) == 1
    assert django.behind_ledger.count(key) == 1


def test_a_read_passes_through_with_the_clients_host(django: Twins, front: Running) -> None:
    answer = passed_through(django.direct.port, front.port, request("GET", "/orders/o-1", HOST))
    assert answer.status == 200
    assert json.loads(answer.body) == {"id": "o-1", "url": f"http://{HOST}/orders/o-1"}


def test_a_host_django_does_not_allow_is_refused_by_django_itself(
    django: Twins, front: Running, key: str
) -> None:
    """The proxy passes the Host on, so Django decides on it: 400, as without the proxy, and a
    replay gets that answer again (nothing executed: the view never ran)."""
    data = request(
        "POST",
        "/orders",
        "intruder.example.net",
        [("Content-Type", "application/json"), ("Idempotency-Key", key)],
        b'{"amount": 1}',
    )
    driven = three_ways(django.direct.port, front.port, data, method="POST")
    assert driven.direct.status == 400
    assert django.behind_ledger.count(key, expected=0) == 0
    # The Host Django refused behind the proxy was the client's (its log, on stderr).
    assert "Invalid HTTP_HOST header: 'intruder.example.net'" in django.behind.log.read_text()
