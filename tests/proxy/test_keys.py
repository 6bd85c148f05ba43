"""SPEC §2.5, §4: which requests are governed, and what makes a key valid."""

from __future__ import annotations

import pytest

from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxychecks import JOB, KEY, REPLAYED, assert_problem, only_job, raw_exchange

from .conftest import ProxyFactory


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "OPTIONS"])
async def test_non_governed_method_with_a_key_passes_through_every_time(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store, method: str
) -> None:
    client = await proxy()
    for _ in range(2):
        async with client.request(method, "/things/1", headers={KEY: "ignored"}) as response:
            assert response.status == 201
            assert REPLAYED not in response.headers
            assert JOB not in response.headers
    assert ledger.count("ignored") == 2  # the key still reaches the backend, untouched
    assert all(e.header(JOB) is None for e in ledger.executions)
    assert await jobs.list_jobs() == []


async def test_post_without_a_key_passes_through_untracked(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy()
    for _ in range(2):
        async with client.post("/payments", data=b"pay") as response:
            assert response.status == 201
            assert REPLAYED not in response.headers
            assert JOB not in response.headers
    assert ledger.count() == 2
    assert await jobs.list_jobs() == []


async def test_require_key_rejects_a_keyless_post_with_key_missing(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(require_key=True)
    async with client.post("/payments", data=b"pay") as response:
        await assert_problem(response, "key-missing", 400)
    async with client.get("/payments") as response:  # not governed: no key needed
        assert response.status == 201
    assert [e.method for e in ledger.executions] == ["GET"]
    assert await jobs.list_jobs() == []


async def test_require_key_per_route(proxy: ProxyFactory, backend_url: str, ledger: Ledger) -> None:
    client = await proxy(
        routes=[{"prefix": "/strict", "upstream": backend_url, "require_key": True}]
    )
    async with client.post("/strict/pay", data=b"pay") as response:
        await assert_problem(response, "key-missing", 400)
    async with client.post("/loose/pay", data=b"pay") as response:
        assert response.status == 201
    assert [e.path_qs for e in ledger.executions] == ["/loose/pay"]


async def test_quoted_and_bare_key_are_the_same_job(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy()
    async with client.post("/payments", data=b"pay", headers={KEY: '"abc"'}) as first:
        assert first.status == 201
        body = await first.read()
    async with client.post("/payments", data=b"pay", headers={KEY: "abc"}) as second:
        assert second.headers[REPLAYED] == "true"
        assert await second.read() == body
    assert ledger.count() == 1
    assert (await only_job(jobs)).key == "abc"


async def test_key_of_255_visible_characters_is_accepted(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy()
    key = "".join(chr(0x21 + i % 94) for i in range(255)).replace('"', "a").replace(",", "b")
    key = key.replace("\\", "c")
    async with client.post("/payments", data=b"pay", headers={KEY: key}) as response:
        assert response.status == 201
    assert (await only_job(jobs)).key == key
    assert ledger.count(key) == 1


@pytest.mark.parametrize(
    "key_headers",
    [
        pytest.param([(KEY, "")], id="empty"),
        pytest.param([(KEY, "k" * 256)], id="256-chars"),
        pytest.param([(KEY, "a"), (KEY, "b")], id="two-headers"),
        pytest.param([(KEY, "a"), (KEY, "a")], id="two-equal-headers"),
        pytest.param([(KEY, "a, b")], id="comma-joined"),
        pytest.param([(KEY, '"a", "b"')], id="comma-joined-quoted"),
        pytest.param([(KEY, '"abc')], id="unbalanced-quote"),
        pytest.param([(KEY, "a b")], id="inner-space"),
        pytest.param([(KEY, '""')], id="empty-quoted"),
    ],
)
async def test_invalid_key_is_400_key_invalid_without_a_job(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store, key_headers: list[tuple[str, str]]
) -> None:
    client = await proxy()
    async with client.post("/payments", data=b"pay", headers=key_headers) as response:
        await assert_problem(response, "key-invalid", 400)
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []


@pytest.mark.parametrize(
    ("raw_key", "parser_may_refuse"),
    [
        pytest.param(b"a\tb", False, id="tab"),
        pytest.param("cl\u00e9".encode(), False, id="non-ascii"),
        # aiohttp's HTTP parser refuses these bytes before the proxy runs: `header-invalid`.
        pytest.param(b"a\x01b", True, id="control-char"),
        pytest.param(b"a\x7fb", True, id="del"),
    ],
)
async def test_key_with_raw_non_visible_bytes_is_rejected_without_a_job(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store, raw_key: bytes, parser_may_refuse: bool
) -> None:
    client = await proxy()
    request = (
        b"POST /payments HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: " + raw_key + b"\r\n"
        b"Content-Length: 3\r\nConnection: close\r\n\r\npay"
    )
    status, headers, _ = await raw_exchange(client, request)
    assert status == 400
    error = dict(headers).get("Idempotency-Error")
    assert error == ("header-invalid" if parser_may_refuse else "key-invalid")
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []
