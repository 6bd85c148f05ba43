"""The other statements of a request's path, each cut after the server committed it
(tests/faults/pgcut.py), as defect 6's are in test_lost_next_attempt.py: the claim, the settle of
an attempt whose upstream refused the connection, and the completion. The client gets `503
store-unavailable`; its retries then get the request run once (or its replay), never `409
outcome-unknown` and never a second execution.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.support.backend import Ledger
from tests.support.faultproxy import FaultProxy

from .conftest import FaultDatabase, GovernedProxy
from .pgcut import StatementCut
from .test_db_faults import job_of, no_leak
from .test_lost_next_attempt import LEASE, SQL
from .traffic import Answer, send

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

# statement: (whether the upstream refuses the first try, the job's state after the cut)
CASES = {
    "claim": (False, "released"),  # nothing forwarded: the proxy releases it (unsent.py)
    "settle": (True, "released"),  # refused, released: the settle itself committed
    # A new key's completion: executed and stored, the retry replays it.
    "complete_sole": (False, "completed"),
}


async def retries_until_answered(session: aiohttp.ClientSession, url: str) -> list[Answer]:
    """Retries a second apart (the proxy's `Retry-After`) until one gets a 201."""
    answers: list[Answer] = []
    until = time.monotonic() + LEASE
    while not answers or answers[-1].status != 201:
        if time.monotonic() >= until:
            raise AssertionError(f"no 201 in time: {answers}")
        answers.append(await send(session, url, "lost"))
        await asyncio.sleep(0.2 if answers[-1].status == 201 else 1.0)
    return answers


@pytest.mark.parametrize("statement", list(CASES))
async def test_a_cut_after_the_commit_runs_the_request_once(
    statement: str,
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
    cut: StatementCut,
) -> None:
    refused, state = CASES[statement]
    backend_url, ledger = recording_backend
    upstream = FaultProxy(urlsplit(backend_url).port or 0)
    await upstream.start()
    if refused:
        await upstream.refuse()
    try:
        proxy = await governed_proxy(
            "app", store=fault_db.dsn_through(cut), upstream=upstream.url, lease=LEASE
        )
        async with aiohttp.ClientSession() as session:
            cut.arm(SQL[statement])
            lost = await send(session, proxy.url, "lost")
            await cut.cut()
            if refused:
                await upstream.start()  # on the same port
            await asyncio.sleep(0.5)  # the proxy's follow-ups, if any (unsent.py: 0.1 s first)
            left = await job_of(fault_db, "lost")
            retries = await retries_until_answered(session, proxy.url)
            replay = await send(session, proxy.url, "lost")
    finally:
        await upstream.close()

    assert (lost.status, lost.error) == (503, "store-unavailable"), lost
    assert cut.cuts == 1
    assert left is not None and left[0] == state, left
    # Until the proxy's follow-up released the job, a retry is held back (on a loaded machine).
    assert {a.problem for a in retries[:-1]} <= {(409, "request-in-flight")}, retries
    assert retries[-1].replayed is (state == "completed"), retries
    assert (replay.status, replay.replayed) == (201, True), replay
    assert ledger.count("lost") == 1
    await no_leak(fault_db)


# statement: (cut before the server has it, the job's state once the restarted proxy is asked)
STOPPED_AT_ONCE = {
    # Committed, answered 503: the follow-up that releases it runs before the proxy exits.
    "claim": (False, "released"),
    # Never sent, the request executed: the outcome the proxy holds is written before it exits.
    "complete_sole": (True, "completed"),
}


@pytest.mark.parametrize("statement", list(STOPPED_AT_ONCE))
async def test_a_proxy_stopped_right_after_the_cut_writes_what_it_holds_first(
    statement: str,
    governed_proxy: GovernedProxy,
    fault_db: FaultDatabase,
    recording_backend: tuple[str, Ledger],
    cut: StatementCut,
) -> None:
    """SIGTERM right after the 503, the store reachable: what the proxy still had to write (the
    release of a claim nothing was forwarded under, or an executed request's response) is
    written before it exits, not left to the lease as `unknown` (docs/operations.md, "Graceful
    shutdown")."""
    unsent, state = STOPPED_AT_ONCE[statement]
    _, ledger = recording_backend
    first = await governed_proxy("process", store=fault_db.dsn_through(cut), lease=LEASE)
    assert first.process is not None
    async with aiohttp.ClientSession() as session:
        cut.arm(SQL[statement], unsent=unsent)
        lost = await send(session, first.url, "lost")
        await cut.cut()
        assert await first.process.terminate() == 0
        left = await job_of(fault_db, "lost")
        second = await governed_proxy("process", store=fault_db.dsn, lease=LEASE)
        retry = await send(session, second.url, "lost")
        replay = await send(session, second.url, "lost")

    assert (lost.status, lost.error) == (503, "store-unavailable"), lost
    assert left is not None and left[0] == state, left
    assert (retry.status, retry.replayed) == (201, state == "completed"), retry
    assert (replay.status, replay.replayed) == (201, True), replay
    assert ledger.count("lost") == 1
    await no_leak(fault_db)
