"""An attempt's outcome that the store could not take (proxy/background/unwritten.py): the client
got 503 after its request was forwarded, and the proxy writes the outcome by the attempt's own
compare-and-swap as soon as the store answers, so that retries get the stored response rather
than finding the job taken over as `unknown` after its lease (docs/operations.md).

The store here fails the write for a while and then works again, which is what a store that
went away for a moment does to it (tests/faults/test_db_faults.py shows it with a session killed
during the completion).
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp.test_utils import TestClient

from idemproxy.core.types import AttemptState, JobState
from idemproxy.errors import StoreUnavailable
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.app import STORES
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import Store
from idemproxy.store.ports import JobStore
from tests.support.backend import Ledger
from tests.support.proxychecks import KEY, assert_problem, eventually, job_with_attempts

from .conftest import ProxyFactory


class FailingWrites:
    """The store's `method` raises StoreUnavailable until `heal()` (or for `seconds`)."""

    def __init__(self, client: TestClient[Any, Any], method: str, seconds: float = 0.0) -> None:
        self.store: JobStore = client.app[CONTEXT].store
        self.record: Store = client.app[STORES].record
        self.method = method
        self.until = time.monotonic() + seconds if seconds else float("inf")
        real = getattr(self.store, method)

        async def failing(*args: Any, **kwargs: Any) -> Any:
            if time.monotonic() < self.until:
                raise StoreUnavailable("the store went away")
            return await real(*args, **kwargs)

        setattr(self.store, method, failing)

    def heal(self) -> None:
        self.until = 0.0


def _counted(
    client: TestClient[Any, Any], outcome: str, name: str = "idemproxy_unwritten_outcomes_total"
) -> float:
    metrics: Metrics = client.app[CONTEXT].metrics
    value = metrics.registry.get_sample_value(name, {"outcome": outcome})
    return value or 0.0


def _attempts(client: TestClient[Any, Any], outcome: str) -> float:
    """`idemproxy_attempts_total{outcome}`: every attempt counted once it ended."""
    return _counted(client, outcome, "idemproxy_attempts_total")


async def _post(
    client: TestClient[Any, Any], key: str, path: str = "/payments"
) -> tuple[int, str | None, bytes]:
    async with client.post(path, data=b"pay", headers={KEY: key}) as response:
        body = await response.read()
        return response.status, response.headers.get("Idempotent-Replayed"), body


async def _state(store: JobStore, key: str) -> JobState | None:
    job = await store.get("anonymous", key)
    return None if job is None else job.state


async def test_a_completion_the_store_missed_is_written_and_retries_get_it(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy(lease=30.0)
    failing = FailingWrites(client, "complete")
    async with client.post("/payments", data=b"pay", headers={KEY: "k"}) as response:
        problem = await assert_problem(response, "store-unavailable", 503)
        assert "was forwarded" in problem["detail"]
    failing.heal()
    await eventually(lambda: len(client.app[CONTEXT].unwritten) == 0)

    job = await job_with_attempts(failing.record, "k")
    assert (job.state, job.completed_by) == (JobState.COMPLETED, 1)
    assert [a.state for a in job.attempts] == [AttemptState.SUCCEEDED]
    assert _counted(client, "written") == 1
    # The attempt ended when its completion was written, not when the client got its 503.
    assert (_attempts(client, "succeeded"), _attempts(client, "unknown")) == (1, 0)
    status, replayed, body = await _post(client, "k")
    assert (status, replayed) == (201, "true")
    assert json.loads(body)["execution"] == 1
    assert ledger.count("k") == 1


async def test_a_duplicate_held_behind_it_gets_the_replay(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """Without the write it would be held until its max_wait, then told 409 request-in-flight;
    after the lease, 409 outcome-unknown."""
    client = await proxy(lease=30.0, max_wait=10.0)
    FailingWrites(client, "complete", seconds=0.4)
    assert (await _post(client, "k"))[0] == 503
    started = time.monotonic()
    status, replayed, body = await _post(client, "k")  # held until the write lands
    assert (status, replayed) == (201, "true")
    assert time.monotonic() - started < 5.0
    assert json.loads(body)["execution"] == 1
    assert ledger.count("k") == 1


async def test_a_settlement_the_store_missed_is_written(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """The upstream said 503 (nothing executed, SPEC §3.2): once written, the job is released
    and the retry runs it."""
    client = await proxy(lease=30.0)
    failing = FailingWrites(client, "settle")
    async with client.post("/payments?status=503", data=b"pay", headers={KEY: "k"}) as response:
        await assert_problem(response, "store-unavailable", 503)
    failing.heal()
    await eventually(lambda: len(client.app[CONTEXT].unwritten) == 0)
    job = await job_with_attempts(failing.record, "k")
    assert job.state is JobState.RELEASED
    assert [a.state for a in job.attempts] == [AttemptState.FAILED]
    assert _attempts(client, "failed") == 1  # when it failed, and only then
    status, replayed, _ = await _post(client, "k", "/payments?status=503")
    assert (status, replayed) == (503, None)  # the retry ran: the upstream's own 503 again
    assert ledger.count("k") == 2
    job = await job_with_attempts(failing.record, "k")
    assert job.state is JobState.RELEASED
    assert [a.state for a in job.attempts] == [AttemptState.FAILED, AttemptState.FAILED]


async def test_a_job_taken_over_first_stays_unknown(proxy: ProxyFactory, ledger: Ledger) -> None:
    """The store came back only after the lease: the next request took the job over, and the
    late write loses its compare-and-swap (SPEC §3.3: only a resolution ends unknown)."""
    client = await proxy(lease=0.3, pool={"store_timeout": 0.15}, max_wait=5.0)
    failing = FailingWrites(client, "complete")
    assert (await _post(client, "k"))[0] == 503
    status, _, body = await _post(client, "k")  # held, then takes the job over
    assert (status, json.loads(body)["code"]) == (409, "outcome-unknown")
    failing.heal()
    await eventually(lambda: len(client.app[CONTEXT].unwritten) == 0, timeout=5.0)
    assert await _state(failing.store, "k") is JobState.UNKNOWN
    assert _counted(client, "moved_on") == 1
    # Its result lost to the job's move: the attempt is counted as a discarded result.
    assert (_attempts(client, "discarded"), _attempts(client, "succeeded")) == (1, 0)
    assert ledger.count("k") == 1
