"""json-server (npm, the version tests/fidelity/node/package-lock.json pins), the mock REST
API many front-end teams start with: `POST /items` answers 201 with the new item and a
`Location` built from the request's Host. Each twin starts from the same `db.json`, so the
ids it gives are the same on both as long as each intent executes once; an execution is an
item in the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fidelity.drive import Ledger, Twins, passed_through, three_ways, twins
from tests.fidelity.servers import Running, proxy
from tests.fidelity.wire import request

HOST = "mock.example.com"


def _tokens(db: Path) -> list[str]:
    """The executions json-server wrote: one item per POST, named by its `token`."""
    return [item["token"] for item in json.loads(db.read_text())["items"]]


@pytest.fixture(scope="module")
def json_server(json_server_binary: str, logs: Path) -> Iterator[Twins]:
    def command(port: int, db: Path) -> list[str]:
        return [json_server_binary, "--host", "127.0.0.1", "--port", str(port), "--quiet", str(db)]

    def ledger(db: Path) -> Ledger:
        return Ledger(db, _tokens)

    seed = '{"items": []}'
    with twins("json-server", command, logs, ledger, seed=seed, suffix=".json") as running:
        yield running


@pytest.fixture(scope="module")
def front(json_server: Twins, proxy_store: str, logs: Path) -> Iterator[Running]:
    with proxy(json_server.behind.url, proxy_store, logs) as running:
        yield running


def test_a_created_item_is_named_at_the_clients_host_and_created_once(
    json_server: Twins, front: Running, key: str
) -> None:
    body = json.dumps({"token": key, "amount": 3}).encode()
    fields = [("Content-Type", "application/json"), ("Idempotency-Key", key)]
    data = request("POST", "/items", HOST, fields, body)
    driven = three_ways(json_server.direct.port, front.port, data, method="POST")
    assert driven.direct.status == 201, driven.direct.describe()
    item = json.loads(driven.replay.body)
    assert driven.first.value("Location") == f"http://{HOST}/items/{item['id']}"
    assert json_server.direct_ledger.count(key) == 1
    assert json_server.behind_ledger.count(key) == 1


def test_a_list_passes_through_as_json_server_answers_it(
    json_server: Twins, front: Running
) -> None:
    data = request("GET", "/items?_sort=id&_order=desc&_limit=1", HOST)
    answer = passed_through(json_server.direct.port, front.port, data)
    assert answer.status == 200, answer.describe()
