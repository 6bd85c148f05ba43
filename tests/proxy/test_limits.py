"""SPEC §7, §9: large responses stream through unstored; large requests are refused up front."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from idemproxy.core.types import JobState
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.proxychecks import JOB, KEY, REPLAYED, assert_problem, only_job

from .conftest import ProxyFactory

KEEP = ("Content-Type", "Location", "ETag")


def payload(size: int) -> bytes:
    """What the backend sends for `?size=N`."""
    return bytes(i % 251 for i in range(size))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_response_over_max_stored_body_streams_in_full_and_is_never_re_executed(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store, chunked: bool
) -> None:
    client = await proxy(max_stored_body=1000)
    url = "/export?size=50000" + ("&chunked=1" if chunked else "")
    async with client.post(url, data=b"x", headers={KEY: "big"}) as first:
        assert first.status == 201
        assert await first.read() == payload(50000)
        assert REPLAYED not in first.headers
        original = {name: first.headers[name] for name in (*KEEP, JOB)}

    async with client.post(url, data=b"x", headers={KEY: "big"}) as duplicate:
        assert duplicate.status == 201
        assert await duplicate.read() == b""
        assert duplicate.headers[REPLAYED] == "true"
        assert duplicate.headers["Idempotency-Replay"] == "omitted"
        assert {name: duplicate.headers[name] for name in (*KEEP, JOB)} == original

    assert ledger.count("big") == 1
    job = await only_job(jobs)
    assert job.state is JobState.COMPLETED
    assert job.response is not None and job.response.omitted


async def test_response_of_exactly_max_stored_body_is_stored_and_replayed(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy(max_stored_body=1000)
    for replayed in (None, "true"):
        async with client.post("/export?size=1000", data=b"x", headers={KEY: "fits"}) as response:
            assert await response.read() == payload(1000)
            assert response.headers.get(REPLAYED) == replayed
            assert "Idempotency-Replay" not in response.headers
    assert ledger.count() == 1


async def test_declared_request_body_over_the_limit_is_413_before_any_claim(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(max_request_body=100)
    async with client.post("/upload", data=b"x" * 101, headers={KEY: "big"}) as response:
        await assert_problem(response, "body-too-large", 413)
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []


async def test_chunked_request_body_over_the_limit_is_413_before_any_claim(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy(max_request_body=1000)

    async def body() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b"y" * 100

    async with client.post("/upload", data=body(), headers={KEY: "big"}) as response:
        assert "Content-Length" not in response.request_info.headers
        await assert_problem(response, "body-too-large", 413)
    assert ledger.count() == 0
    assert await jobs.list_jobs() == []


async def test_request_body_at_the_limit_is_accepted_whole(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy(max_request_body=1000)

    async def body() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"z" * 100

    async with client.post("/upload", data=body(), headers={KEY: "fits"}) as response:
        assert response.status == 201
    assert [e.body for e in ledger.executions] == [b"z" * 1000]
