"""SPEC §7, §10: what a replay carries, and which headers never cross the proxy."""

from __future__ import annotations

import gzip
import json
from typing import Any

from idemproxy.core.types import StoredResponse
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxychecks import ATTEMPT, JOB, KEY, REPLAYED, http_date_age, only_job

from .conftest import ProxyFactory

END_TO_END = ("Content-Type", "Location", "ETag")


async def test_replay_keeps_status_body_and_end_to_end_headers(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy()
    request: dict[str, Any] = {"json": {"amount": 10}, "headers": {KEY: "k"}}
    async with client.post("/payments", **request) as first:
        body = await first.read()
        original = {name: first.headers[name] for name in END_TO_END}
        job_id = first.headers[JOB]
    assert first.status == 201
    assert original["Location"] == "/things/1"
    assert original["ETag"] == '"v1"'

    async with client.post("/payments", **request) as replay:
        assert replay.status == 201
        assert await replay.read() == body
        assert {name: replay.headers[name] for name in END_TO_END} == original
        assert replay.headers[REPLAYED] == "true"
        assert replay.headers[JOB] == job_id
        assert int(replay.headers["Content-Length"]) == len(body)
        assert len(replay.headers.getall("Date")) == 1
        assert http_date_age(replay.headers["Date"]) < 5
    stored = (await only_job(jobs)).response
    assert isinstance(stored, StoredResponse)
    # Date and Content-Length are made fresh for every replay, so they are never kept.
    assert not {name.lower() for name, _ in stored.headers} & {"date", "content-length"}
    assert ledger.count() == 1


async def test_204_is_replayed_without_a_body(proxy: ProxyFactory, ledger: Ledger) -> None:
    client = await proxy()
    for replayed in (None, "true"):
        async with client.post("/things/1?status=204", data=b"x", headers={KEY: "k"}) as response:
            assert response.status == 204
            assert await response.read() == b""
            assert response.headers["Location"] == "/things/1"
            assert response.headers.get(REPLAYED) == replayed
    assert ledger.count() == 1


async def test_gzip_body_is_byte_identical_and_replayed_with_its_encoding(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    bodies = []
    for replayed in (None, "true"):
        async with client.post("/report?gzip=1", data=b"x", headers={KEY: "gz"}) as response:
            assert response.status == 201
            assert response.headers["Content-Encoding"] == "gzip"
            assert response.headers.get(REPLAYED) == replayed
            body = await response.read()  # the client does not decompress
            assert int(response.headers["Content-Length"]) == len(body)
            bodies.append(body)
    assert bodies[0] == bodies[1]
    assert json.loads(gzip.decompress(bodies[0]))["execution"] == 1
    assert ledger.count() == 1


async def test_set_cookie_reaches_the_first_client_but_is_never_replayed(
    proxy: ProxyFactory, jobs: Store
) -> None:
    client = await proxy()
    async with client.post("/login?cookie=1", data=b"x", headers={KEY: "c"}) as first:
        assert first.headers["Set-Cookie"] == "session=secret; HttpOnly"
    async with client.post("/login?cookie=1", data=b"x", headers={KEY: "c"}) as replay:
        assert replay.headers[REPLAYED] == "true"
        assert "Set-Cookie" not in replay.headers
    stored = (await only_job(jobs)).response
    assert isinstance(stored, StoredResponse)
    assert "set-cookie" not in {name.lower() for name, _ in stored.headers}


async def test_client_cannot_forge_the_proxy_headers(proxy: ProxyFactory, ledger: Ledger) -> None:
    client = await proxy()
    forged = {REPLAYED: "true", JOB: "forged-job", ATTEMPT: "7", "Idempotency-Replay": "omitted"}
    async with client.post("/payments", data=b"x", headers={KEY: "f", **forged}) as response:
        assert response.status == 201
        assert REPLAYED not in response.headers
        job_id = response.headers[JOB]
    async with client.get("/payments", headers=forged) as response:
        assert response.status == 201
    governed, passed = ledger.executions
    assert [v for k, v in governed.headers if k.lower() == JOB.lower()] == [job_id]
    assert [v for k, v in governed.headers if k.lower() == ATTEMPT.lower()] == ["1"]
    for execution in (governed, passed):
        assert execution.header(REPLAYED) is None
        assert execution.header("Idempotency-Replay") is None
    assert passed.header(JOB) is None
    assert passed.header(ATTEMPT) is None
