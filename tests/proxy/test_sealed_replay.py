"""Encryption at rest through the proxy (SPEC §11), on SQLite and on PostgreSQL with its
in-process replay cache: replays byte for byte from sealed rows, and a row that does not open
is refused without reaching the backend, whatever `on_store_error` says."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.backend import Ledger
from tests.support.keyring import NEW, OLD, OTHER
from tests.support.proxyapp import ProxyClient, ProxyFactory
from tests.support.proxychecks import JOB, KEY, REPLAYED
from tests.support.rawrows import RawRows

SECRET = "4242 4242 4242 4242"
REQUEST: dict[str, Any] = {
    "json": {"card": SECRET},
    "headers": {KEY: "k", "Authorization": "Bearer a"},
}


def ring(*entries: str) -> dict[str, Any]:
    return {"encryption": {"keys": ",".join(entries)}}


async def send(client: ProxyClient, **changes: Any) -> tuple[int, dict[str, str], bytes]:
    async with client.post("/payments", **{**REQUEST, **changes}) as response:
        return response.status, dict(response.headers), await response.read()


async def test_a_sealed_response_replays_byte_for_byte_and_the_row_holds_no_secret(
    proxy: ProxyFactory, ledger: Ledger, store_dsn: str
) -> None:
    client = await proxy(**ring(OLD))
    status, headers, body = await send(client)
    assert status == 201 and SECRET.encode() in body
    for _ in range(2):
        again_status, again_headers, again = await send(client)
        assert (again_status, again, again_headers[REPLAYED]) == (201, body, "true")
        assert again_headers["Location"] == headers["Location"]
    row = await RawRows(store_dsn).job(headers[JOB])
    assert row["response_key"] == "k1" and SECRET.encode() not in bytes(row["response_body"])
    assert ledger.count() == 1


@pytest.mark.parametrize("on_store_error", ["fail_closed", "passthrough"])
async def test_a_row_whose_key_is_gone_is_refused_and_never_forwarded(
    proxy: ProxyFactory, ledger: Ledger, on_store_error: str
) -> None:
    assert (await send(await proxy(**ring(OLD))))[0] == 201
    other = await proxy(**ring(OTHER), on_store_error=on_store_error)

    status, headers, body = await send(other)

    assert status == 500
    assert headers["Idempotency-Error"] == "response-unreadable"
    problem = json.loads(body)
    assert "'k1'" in problem["detail"] and SECRET not in body.decode()
    assert ledger.count() == 1


async def test_the_fingerprint_is_checked_before_the_row_is_opened(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    assert (await send(await proxy(**ring(OLD))))[0] == 201
    other = await proxy(**ring(OTHER))
    status, headers, _ = await send(other, json={"card": "another"})
    assert (status, headers["Idempotency-Error"]) == (409, "payload-mismatch")
    assert ledger.count() == 1


async def test_rows_from_before_encryption_and_under_an_older_key_still_replay(
    proxy: ProxyFactory, ledger: Ledger, store_dsn: str
) -> None:
    clear = await send(await proxy(), headers={**REQUEST["headers"], KEY: "clear"})
    old = await send(await proxy(**ring(OLD)), headers={**REQUEST["headers"], KEY: "old"})
    rotated = await proxy(**ring(NEW, OLD))
    for key, (status, _, body) in (("clear", clear), ("old", old)):
        again = await send(rotated, headers={**REQUEST["headers"], KEY: key})
        assert (again[0], again[2], again[1][REPLAYED]) == (status, body, "true")
    new = await send(rotated, headers={**REQUEST["headers"], KEY: "new"})
    assert (await RawRows(store_dsn).job(new[1][JOB]))["response_key"] == "k2"
    assert ledger.count() == 3
