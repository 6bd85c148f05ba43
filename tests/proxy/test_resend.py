"""SPEC §3.6: on a route whose upstream honours the key, a retry of an `unknown` job sends the
same request again under it, and the upstream's final answer completes the job; never on a
route that did not declare it, past the window, or for other bytes. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from yarl import URL

from idemproxy.core.types import JobState
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from tests.support.keyed import Keyed, keyed_backend
from tests.support.proxyapp import ProxyClient, ProxyFactory
from tests.support.proxychecks import refusing

TIMEOUT = 0.3  # the route's upstream_timeout; the first request of a key takes `SLOW`
SLOW = 0.8
BODY = b'{"amount": 5, "currency": "EUR"}'


@pytest.fixture
def keyed() -> Keyed:
    return Keyed(delay=SLOW)


@pytest.fixture
async def backend(keyed: Keyed) -> AsyncIterator[str]:
    async with keyed_backend(keyed) as url:
        yield url


def settings(backend: str, store_dsn: str, window: float | None = 3600) -> dict[str, Any]:
    route: dict[str, Any] = {"prefix": "/charges", "upstream": backend, "upstream_timeout": TIMEOUT}
    if window is not None:
        route["resolve"] = {"upstream_honours_key": {"window": window}}
    return {"store": store_dsn, "upstream": backend, "routes": [route]}


async def charge(client: ProxyClient, key: str, body: bytes = BODY) -> tuple[int, dict[str, Any]]:
    response = await client.post(
        "/charges",
        data=body,
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )
    return response.status, await response.json()


async def test_a_retry_sends_it_again_and_the_upstreams_answer_completes_it(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, keyed: Keyed, jobs: Store
) -> None:
    client = await make_proxy(**settings(backend, store_dsn))
    assert (await charge(client, "k1"))[0] == 504  # unknown: still running at the upstream
    # At once: the upstream says the first is still in progress (its own 409, passed on as
    # any upstream answer is): it stays unknown.
    status, answer = await charge(client, "k1")
    assert (status, answer) == (409, {"error": "in progress"})
    job = await jobs.get("anonymous", "k1")
    assert job is not None and job.state is JobState.UNKNOWN
    await asyncio.sleep(SLOW)
    # Once the first is done, the upstream answers the key with its first response.
    status, body = await charge(client, "k1")
    assert (status, body["charge"], body["attempt"]) == (201, "ch_k1_1", "1")
    assert keyed.executions["k1"] == 1 and keyed.requests["k1"] == 3
    done = await jobs.get_by_id(job.id)
    assert done is not None and (done.state, done.completed_by) == (JobState.COMPLETED, 3)
    assert [a.state.value for a in done.attempts] == ["unknown", "unknown", "succeeded"]
    assert {a.upstream for a in done.attempts} == {backend}
    # Evidence on the attempts asked about; counted by way and result.
    evidence = [e for a in done.attempts for e in a.evidence if e.way == "upstream_key"]
    assert [e.reason for e in evidence] == [
        "sent again as attempt 2: unknown",
        "sent again as attempt 3: completed",
    ]
    assert [e.status for e in evidence] == [409, 201]
    assert all(e.answered_at is not None for e in evidence)
    registry = client.app[CONTEXT].metrics.registry
    labels = {"way": "upstream_key", "result": "completed"}
    assert registry.get_sample_value("idemproxy_resolutions_total", labels) == 1
    # And later retries replay it.
    status, body = await charge(client, "k1")
    assert (status, body["charge"]) == (201, "ch_k1_1")
    assert keyed.requests["k1"] == 3


async def test_never_on_a_route_that_did_not_declare_it(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, keyed: Keyed
) -> None:
    keyed.honours = False
    client = await make_proxy(**settings(backend, store_dsn, window=None))
    assert (await charge(client, "k2"))[0] == 504
    await asyncio.sleep(SLOW)
    for _ in range(3):
        assert (await charge(client, "k2"))[0] == 409
    assert keyed.requests["k2"] == 1 and keyed.executions["k2"] == 1


async def test_never_past_the_window(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, keyed: Keyed
) -> None:
    client = await make_proxy(**settings(backend, store_dsn, window=SLOW))
    assert (await charge(client, "k3"))[0] == 504
    await asyncio.sleep(SLOW + 0.2)
    assert (await charge(client, "k3"))[0] == 409
    assert keyed.requests["k3"] == 1


async def test_never_for_other_bytes_of_the_same_fingerprint(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, keyed: Keyed
) -> None:
    client = await make_proxy(**settings(backend, store_dsn))
    assert (await charge(client, "k4"))[0] == 504
    await asyncio.sleep(SLOW)
    # The same JSON, members in another order: the same fingerprint (SPEC §6), other bytes.
    status, problem = await charge(client, "k4", b'{"currency": "EUR", "amount": 5}')
    assert (status, problem["code"]) == (409, "outcome-unknown")
    assert keyed.requests["k4"] == 1
    # The very same bytes are sent again.
    assert (await charge(client, "k4"))[0] == 201
    assert keyed.requests["k4"] == 2 and keyed.executions["k4"] == 1


@pytest.mark.parametrize("answer", [408, 425, 429, 500, 502, 503, 504])
async def test_an_answer_that_proves_nothing_leaves_it_unknown(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, keyed: Keyed, jobs: Store, answer: int
) -> None:
    client = await make_proxy(**settings(backend, store_dsn))
    assert (await charge(client, "k5"))[0] == 504
    await asyncio.sleep(SLOW)
    keyed.answers.append(answer)
    assert (await charge(client, "k5"))[0] == answer
    job = await jobs.get("anonymous", "k5")
    assert job is not None and job.state is JobState.UNKNOWN  # never released
    assert (await charge(client, "k5"))[0] == 201  # sent again, answered for good
    assert keyed.executions["k5"] == 1


async def test_concurrent_retries_send_it_once(
    make_proxy: ProxyFactory, store_dsn: str, backend: str, keyed: Keyed
) -> None:
    client = await make_proxy(**settings(backend, store_dsn))
    assert (await charge(client, "k6"))[0] == 504
    await asyncio.sleep(SLOW)
    keyed.delay = 0.2
    answers = await asyncio.gather(*(charge(client, "k6") for _ in range(5)))
    assert {status for status, _ in answers} == {201}
    assert keyed.requests["k6"] == 2 and keyed.executions["k6"] == 1


async def test_an_upstream_that_cannot_be_reached_leaves_it_unknown(
    make_proxy: ProxyFactory, store_dsn: str, jobs: Store
) -> None:
    """Nothing reached the upstream this time, but the first attempt may have executed: the
    job is never released (SPEC §3.2's connect failure releases only a first send)."""
    keyed = Keyed(delay=SLOW)
    async with keyed_backend(keyed) as gone:
        client = await make_proxy(**settings(gone, store_dsn))
        assert (await charge(client, "k7"))[0] == 504
        await asyncio.sleep(SLOW)
    with refusing(URL(gone).port or pytest.fail()):
        assert (await charge(client, "k7"))[0] == 502
    job = await jobs.get_by_id((await jobs.get("anonymous", "k7") or pytest.fail()).id)
    assert job is not None and job.state is JobState.UNKNOWN
    assert [a.state.value for a in job.attempts] == ["unknown", "unknown"]
    # No upstream answered: the evidence says so, not the proxy's own 502 (SPEC §3.6).
    (resent,) = job.attempts[0].evidence
    assert (resent.status, resent.answered_at, resent.verdict) == (None, None, "unknown")
