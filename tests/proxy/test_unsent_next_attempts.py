"""A next attempt whose statement commits after the proxy answered 503 for it: nothing was
forwarded under it, so it is released as a failed claim's job is (proxy/background/unsent.py).

The attempt before it proved nothing executed (a refused connection): `start_next_attempt` (a
retry of the released job) or `fail_over` (the next upstream) then commits and its answer is
lost. Without the release the job stayed in flight until its lease ran out, then every retry got
`409 outcome-unknown`, with nothing ever executed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from idemproxy.core.types import AttemptState, Intent, JobState
from idemproxy.errors import StoreUnavailable
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.app import STORES
from idemproxy.proxy.background.unsent import NEVER_FORWARDED, UnsentClaims
from idemproxy.proxy.context import CONTEXT
from idemproxy.store.base import AttemptFailure, Store
from idemproxy.store.factory import create_store
from idemproxy.store.ports import JobStore
from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient
from tests.support.proxychecks import (
    KEY,
    closed_port,
    eventually,
    job_with_attempts,
    settle_quietly,
)

from .conftest import ProxyFactory

Call = Callable[..., Awaitable[Any]]
_REFUSED, _FAILED = AttemptState.FAILED, AttemptState.FAILED


def _lose_answers(client: ProxyClient, name: str) -> JobStore:
    """Every call of the store's `name` commits, then fails as a lost answer does."""
    store = client.app[CONTEXT].store
    real: Call = getattr(store, name)

    async def committed_then_lost(*args: Any, **kwargs: Any) -> Any:
        await real(*args, **kwargs)
        raise StoreUnavailable("the connection was cut after the server committed")

    setattr(store, name, committed_then_lost)
    return store


async def _post(client: ProxyClient, path: str, key: str) -> int:
    async with client.post(path, data=b"pay", headers={KEY: key}) as response:
        return response.status


@pytest.fixture
async def late_upstream() -> AsyncIterator[tuple[str, Callable[[], Awaitable[list[str]]]]]:
    """An upstream URL that refuses connections until the returned `start()` is awaited; then
    every execution lands in the list it returns."""
    port = closed_port()
    executions: list[str] = []
    runners: list[web.AppRunner] = []

    async def handle(request: web.Request) -> web.Response:
        executions.append(request.headers.get(KEY, ""))
        return web.Response(status=201, text="done")

    async def start() -> list[str]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return executions

    yield f"http://127.0.0.1:{port}", start
    for runner in runners:
        await runner.cleanup()


async def test_a_lost_answer_to_start_next_attempt_is_released_and_the_retry_runs_once(
    proxy: ProxyFactory, late_upstream: tuple[str, Callable[[], Awaitable[list[str]]]]
) -> None:
    url, start = late_upstream
    client = await proxy(lease=30.0, routes=[{"prefix": "/late", "upstream": url}])
    assert await _post(client, "/late/pay", "next") == 502  # refused: released
    executions = await start()
    store = _lose_answers(client, "start_next_attempt")
    assert await _post(client, "/late/pay", "next") == 503
    del store.start_next_attempt  # the class's method again

    await eventually(lambda: len(client.app[CONTEXT].unsent) == 0)
    job = await job_with_attempts(client.app[STORES].record, "next")
    assert (job.state, job.attempt_count) == (JobState.RELEASED, 2)
    assert [(a.state, a.error) for a in job.attempts][1] == (_FAILED, NEVER_FORWARDED)
    assert executions == []
    assert await _post(client, "/late/pay", "next") == 201  # the retry runs it, once
    assert await _post(client, "/late/pay", "next") == 201  # a replay
    assert executions == ["next"]


async def test_a_lost_answer_to_fail_over_is_released_and_the_retry_runs_once(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger
) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    routes = [{"prefix": "/v1", "upstream": dead, "fallbacks": [backend_url]}]
    client = await proxy(lease=30.0, routes=routes)
    store = _lose_answers(client, "fail_over")
    assert await _post(client, "/v1/pay", "over") == 503
    del store.fail_over  # the class's method again

    await eventually(lambda: len(client.app[CONTEXT].unsent) == 0)
    job = await job_with_attempts(client.app[STORES].record, "over")
    assert (job.state, job.attempt_count) == (JobState.RELEASED, 2)
    assert [(a.state, a.upstream) for a in job.attempts] == [
        (_REFUSED, dead),
        (_FAILED, backend_url),
    ]
    assert job.attempts[1].error == NEVER_FORWARDED
    assert ledger.count() == 0
    assert await _post(client, "/v1/pay", "over") == 201  # refused again, then the fallback
    assert ledger.count("over") == 1


# --- UnsentClaims on its own, against a real store ----------------------------------------


@pytest.fixture
async def store(store_dsn: str) -> AsyncIterator[Store]:
    store = create_store(store_dsn)
    await store.open()
    await store.migrate()
    try:
        yield store
    finally:
        await store.close()


async def test_another_retrys_next_attempt_is_left_alone(store: Store) -> None:
    """Our `start_next_attempt` never committed and another retry's did, at the same version
    and attempt number: its attempt is running, and releasing it would let a third retry run
    the request again. Only the statement's own token tells the two apart."""
    intent = Intent("alice", "raced", "fp", "POST", "/payments")
    claimed = await store.claim(intent, str(uuid.uuid4()), "a", ttl=3600.0, lease=30.0)
    assert await store.settle(claimed.job, 1, JobState.RELEASED, error="refused")
    released = await store.get("alice", "raced")
    assert released is not None
    theirs = await store.start_next_attempt(released, "a", lease=30.0, token=str(uuid.uuid4()))
    assert theirs is not None
    metrics = Metrics()
    unsent = UnsentClaims(store, metrics.unsent_outcome, lease=30.0)
    unsent.note_next(released, str(uuid.uuid4()))  # ours: never committed
    await eventually(lambda: len(unsent) == 0)
    await unsent.close()
    job = await store.get("alice", "raced")
    assert job is not None and (job.state, job.version) == (JobState.IN_FLIGHT, theirs.job.version)
    assert metrics.registry.get_sample_value(
        "idemproxy_unsent_claims_total", {"outcome": "moved_on"}
    )


async def test_a_fail_over_that_commits_late_is_awaited_then_released(store: Store) -> None:
    """A stalled server may commit the statement after the proxy gave up: until then the job
    is still at the version before it, and is looked for again."""
    intent = Intent("alice", "stalled", "fp", "POST", "/payments")
    claimed = await store.claim(intent, str(uuid.uuid4()), "a", ttl=3600.0, lease=30.0)
    metrics = Metrics()
    unsent = UnsentClaims(store, metrics.unsent_outcome, lease=30.0)
    token = str(uuid.uuid4())
    unsent.note_next(claimed.job, token)
    await settle_quietly(0.5)  # looked for several times (the first pause is 0.1 s)
    assert len(unsent) == 1
    failure = AttemptFailure(None, "refused")
    assert await store.fail_over(claimed.job, 1, "b", failure=failure, lease=30.0, token=token)
    await eventually(lambda: len(unsent) == 0)
    await unsent.close()
    job = await job_with_attempts(store, "stalled", owner="alice")
    assert (job.state, job.attempt_count) == (JobState.RELEASED, 2)
    assert [(a.state, a.error) for a in job.attempts] == [
        (_REFUSED, "refused"),
        (_FAILED, NEVER_FORWARDED),
    ]


async def test_a_later_statement_for_the_same_job_takes_the_watch_and_counts_the_older_moved_on(
    store: Store,
) -> None:
    """One statement per job is watched: a later one for the same job (the job moved on from
    the older) takes its place, and the older is counted as moved on, not lost from the
    counts (proxy/background/followups.py)."""
    intent = Intent("alice", "twice", "fp", "POST", "/payments")
    claimed = await store.claim(intent, str(uuid.uuid4()), "a", ttl=3600.0, lease=30.0)
    metrics = Metrics()
    unsent = UnsentClaims(store, metrics.unsent_outcome, lease=30.0)
    token = str(uuid.uuid4())
    unsent.note("alice", "twice", claimed.job.id)
    unsent.note_next(claimed.job, token)
    assert len(unsent) == 1

    def counted(outcome: str) -> float | None:
        labels = {"outcome": outcome}
        return metrics.registry.get_sample_value("idemproxy_unsent_claims_total", labels)

    assert counted("moved_on") == 1
    failure = AttemptFailure(None, "refused")
    assert await store.fail_over(claimed.job, 1, "b", failure=failure, lease=30.0, token=token)
    await eventually(lambda: len(unsent) == 0)
    await unsent.close()
    assert (counted("released"), counted("moved_on")) == (1, 1)
