"""Two proxy processes on one PostgreSQL database: one job per intent across replicas (SPEC §11)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aiohttp
import pytest

from idemproxy.constants import WAITER_RECHECK_SECONDS
from tests.support.client import send

if TYPE_CHECKING:
    from .conftest import Backend, StartProxy

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

DUPLICATES = 20
UPSTREAM_DELAY = 0.3
# A held duplicate on the other process must be woken by LISTEN/NOTIFY, not by its periodic
# re-read (every WAITER_RECHECK_SECONDS): without the notification the spread would be ~1.7 s.
WAKE_BUDGET = 1.0


async def test_duplicates_split_across_two_processes_execute_once(
    replicated_dsn: str, backend: Backend, start_proxy: StartProxy
) -> None:
    """On PostgreSQL and on a Citus cluster's coordinator alike (whose workers hold the job)."""
    pg_dsn = replicated_dsn
    assert WAKE_BUDGET < WAITER_RECHECK_SECONDS - UPSTREAM_DELAY
    proxies = await asyncio.gather(
        start_proxy("--upstream", backend.url, "--store", pg_dsn, name="replica-a"),
        start_proxy("--upstream", backend.url, "--store", pg_dsn, name="replica-b"),
    )
    key = "order-42"
    url = f"/payments?delay={UPSTREAM_DELAY}"
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(
            *(send(session, proxies[i % 2].url + url, key=key) for i in range(DUPLICATES))
        )

    assert backend.ledger.count(key) == 1, [p.describe() for p in proxies]
    assert {a.status for a in answers} == {201}
    assert len({a.body for a in answers}) == 1, "every answer is byte-identical"
    executed = [i for i, a in enumerate(answers) if not a.replayed]
    assert len(executed) == 1, "one answer came from the upstream, the others are replays"
    # SPEC §10: the backend saw the same job id that every client was given.
    job = backend.ledger.executions[0].header("Idempotency-Job")
    assert job is not None
    assert {a.job for a in answers} == {job}

    first = answers[executed[0]]
    assert all(a.sent_at < first.done_at for a in answers), "the duplicates overlapped"
    other = [a for i, a in enumerate(answers) if i % 2 != executed[0] % 2]
    assert len(other) == DUPLICATES // 2
    spread = max(a.done_at for a in other) - first.done_at
    assert spread < WAKE_BUDGET, f"held duplicates on the other process woke after {spread:.2f}s"

    # Later retries on either process are plain replays of the same job.
    async with aiohttp.ClientSession() as session:
        later = [await send(session, p.url + url, key=key) for p in proxies]
    assert [(a.status, a.body, a.job, a.replayed) for a in later] == [
        (201, first.body, job, True)
    ] * 2
    assert backend.ledger.count(key) == 1
