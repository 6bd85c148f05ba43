"""nginx (Debian's package) with name-based virtual hosts, run as a process of the test's own
(its configuration, port and logs in a folder of the test's, never the system service): the
site a request gets, and the redirect nginx makes for a directory, follow the Host it got.

nginx's access log is the ledger: one line per request it executed.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fidelity.drive import Ledger, passed_through, three_ways
from tests.fidelity.servers import ROOT, Running, proxy, serving
from tests.fidelity.wire import request

CONFIG = ROOT / "tests" / "fidelity" / "apps" / "nginx.conf"
SITES = {"default": "the default site\n", "a": "site a\n", "b": "site b\n"}


def _site_folder(logs: Path) -> Path:
    root = logs / "nginx"
    for site, text in SITES.items():
        (root / site).mkdir(parents=True)
        (root / site / "index.html").write_text(text)
    (root / "a" / "dir").mkdir()
    (root / "a" / "dir" / "index.html").write_text("a directory of site a\n")
    (root / "tmp").mkdir()
    return root


def _orders(access_log: Path) -> list[str]:
    """The Idempotency-Key of every POST /orders nginx executed."""
    lines = [line.split(" ") for line in access_log.read_text().splitlines()]
    return [line[3] for line in lines if line[1:3] == ["POST", "/orders"]]


def _hosts(access_log: Path, target: str) -> list[str]:
    """The Host nginx saw for each request for `target`."""
    lines = [line.split(" ") for line in access_log.read_text().splitlines()]
    return [line[0] for line in lines if line[2] == target]


@pytest.fixture(scope="module")
def nginx(nginx_binary: str, logs: Path) -> Iterator[Running]:
    root = _site_folder(logs)
    # Its workers read the test's folders: as the test's user when nginx starts as root.
    user = f"user {getpass.getuser()};" if os.geteuid() == 0 else ""

    def command(port: int) -> list[str]:
        conf = root / f"nginx-{port}.conf"
        text = CONFIG.read_text().replace("@PORT@", str(port)).replace("@ROOT@", str(root))
        conf.write_text(text.replace("@USER@", user))
        return [nginx_binary, "-p", str(root), "-e", str(root / "error.log"), "-c", str(conf),
                "-g", "daemon off;"]  # fmt: skip

    with serving("nginx", command, logs) as running:
        yield running


@pytest.fixture(scope="module")
def front(nginx: Running, proxy_store: str, logs: Path) -> Iterator[Running]:
    with proxy(nginx.url, proxy_store, logs) as running:
        yield running


@pytest.mark.parametrize("site", ["a", "b"])
def test_each_name_gets_its_own_site(nginx: Running, front: Running, site: str) -> None:
    answer = passed_through(nginx.port, front.port, request("GET", "/", f"{site}.example.com"))
    assert answer.body == SITES[site].encode()


def test_an_unknown_name_gets_the_default_site(
    nginx: Running, front: Running, key: str, logs: Path
) -> None:
    target = f"/?probe={key}"
    answer = passed_through(nginx.port, front.port, request("GET", target, "c.example.com"))
    assert answer.body == SITES["default"].encode()
    # Both requests were answered for the client's name, not the proxy's upstream address.
    hosts = Ledger(logs / "nginx" / "access.log", lambda log: _hosts(log, target))
    assert hosts.count("c.example.com", expected=2) == 2


def test_a_directory_redirect_names_the_clients_host(nginx: Running, front: Running) -> None:
    answer = passed_through(nginx.port, front.port, request("GET", "/dir", "a.example.com"))
    assert answer.status == 301
    # nginx adds the port it listens on (port_in_redirect): the name is the client's.
    assert answer.value("Location") == f"http://a.example.com:{nginx.port}/dir/"


def test_a_post_runs_once_on_its_virtual_host(
    nginx: Running, front: Running, key: str, logs: Path
) -> None:
    fields = [("Idempotency-Key", key), ("Content-Type", "application/json")]
    data = request("POST", "/orders", "a.example.com", fields, b"{}")
    ledger = Ledger(logs / "nginx" / "access.log", _orders)
    direct_before = ledger.count(key, expected=0)
    driven = three_ways(nginx.port, front.port, data, method="POST")
    assert driven.first.value("Location") == f"http://a.example.com/orders/{key}"
    # One execution for the direct request, one for the proxied one: none for the replay.
    assert ledger.count(key, expected=direct_before + 2) == direct_before + 2
