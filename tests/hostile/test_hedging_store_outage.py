"""Hedging while the store fails one racer's outcome (SPEC §3.4: once any racer may have
executed, no further upstream is brought in).

A racer that ended with a store error (its outcome not written) was kept apart from the failed
racers, and only those were asked whether one may have executed: so a fallback that answered
502 (unknown: it may have executed) while the store could not take that outcome let the hedge
timer bring in the next upstream, a third execution of one payment. Each upstream counts the
requests it got.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from idemproxy.core.types import Job, JobState
from idemproxy.errors import StoreUnavailable
from idemproxy.store.sqlite.store import SqliteStore
from tests.support.marker_upstream import MarkerUpstream, answer
from tests.support.proxyapp import ProxyFactory
from tests.support.proxychecks import KEY


class SettleFails(SqliteStore):
    """The real SQLite store, whose first write of attempt `number`'s outcome fails."""

    def __init__(self, path: str, number: int) -> None:
        super().__init__(path)
        self.number = number
        self.failed = 0

    async def finish_attempt(self, job: Job, attempt: int, state: JobState, **kwargs: Any) -> None:
        if attempt == self.number and not self.failed:
            self.failed += 1
            raise StoreUnavailable("the store did not answer")
        await super().finish_attempt(job, attempt, state, **kwargs)


@pytest.fixture
async def upstreams() -> AsyncIterator[list[MarkerUpstream]]:
    started = [
        # The primary answers last; the first fallback fails at once with an unknown outcome.
        await MarkerUpstream("primary", {"/pay": answer(delay=1.0)}).start(),
        await MarkerUpstream("fallback", {"/pay": answer(502, delay=0.05)}).start(),
        await MarkerUpstream("third", {"/pay": answer()}).start(),
    ]
    try:
        yield started
    finally:
        for upstream in started:
            await upstream.close()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SettleFails]:
    """Requested before the proxy, so closed after it."""
    opened = SettleFails(str(tmp_path / "race.db"), number=2)  # attempt 2: the fallback's
    await opened.open()
    await opened.migrate()
    try:
        yield opened
    finally:
        await opened.close()


async def test_a_racer_whose_outcome_the_store_lost_stops_further_hedges(
    store: SettleFails, make_proxy: ProxyFactory, upstreams: list[MarkerUpstream], tmp_path: Path
) -> None:
    primary, fallback, third = upstreams
    client = await make_proxy(
        inject_store=store,
        store=f"sqlite:///{tmp_path / 'race.db'}",
        upstream=primary.url,
        fallbacks=[fallback.url, third.url],
        hedge_after=0.2,
    )
    async with client.post("/pay", data=b"pay", headers={KEY: "race", "X-Marker": "m1"}) as first:
        assert first.status == 200
        assert first.headers["X-Upstream"] == "primary"
    assert store.failed == 1, "the fallback's outcome was not refused: the test proves nothing"
    assert (primary.count("m1"), fallback.count("m1")) == (1, 1)
    assert third.count("m1") == 0  # the fallback may have executed: no third upstream
