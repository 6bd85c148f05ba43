"""A completion whose batch committed but whose answer came after its timeout (SPEC §1, §7):
retried alone it loses its compare-and-swap to its own batch, and the proxy re-reads the job
and answers with the response it holds, the one the backend gave, executed once."""

from __future__ import annotations

import asyncio
import functools
import logging

import pytest

from idemproxy.proxy.app import STORES
from tests.support.backend import Ledger
from tests.support.proxychecks import KEY
from tests.support.slowreplies import SlowReplies

from .conftest import ProxyFactory

STORE_TIMEOUT = 2.0
CONCURRENT = 8


def _late_batch_answers(relay: SlowReplies, seen: list[int], kind: str, rows: int) -> None:
    """As a completion batch goes out: its answer comes after its timeout (half the store
    timeout); the rows retried alone a moment later are answered at once."""
    if kind == "complete" and rows > 1:
        seen.append(rows)
        relay.delay_next_run(STORE_TIMEOUT * 0.75, lasting=STORE_TIMEOUT * 0.25)


@pytest.mark.postgres
async def test_a_completion_whose_batch_answer_was_lost_replays_its_own_response(
    make_proxy: ProxyFactory, pg_dsn: str, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="idemproxy.proxy.jobs.jobrun")
    relay = SlowReplies(pg_dsn)
    async with relay as slow_dsn:
        # One connection, which has prepared every statement after the first round: a batch's
        # statement runs as soon as it is sent.
        client = await make_proxy(
            store=slow_dsn, pool={"store_timeout": STORE_TIMEOUT, "store_connections": 1}
        )

        async def post(key: str) -> tuple[int, bytes]:
            # The same short delay for all: their answers, and completions, come together.
            async with client.post("/payments?delay=0.2", data=b"pay", headers={KEY: key}) as r:
                return r.status, await r.read()

        for round_ in range(2):
            await asyncio.gather(*(post(f"warm-{round_}-{i}") for i in range(CONCURRENT)))
        batched: list[int] = []
        for batcher in client.app[STORES].record.group_commits():
            batcher.observer = functools.partial(_late_batch_answers, relay, batched, batcher.kind)

        keys = [f"lost-{i}" for i in range(CONCURRENT)]
        first = await asyncio.gather(*(post(key) for key in keys))
        assert batched, "some completions went out in a batch"
        lost = [r for r in caplog.records if r.getMessage().startswith("late result discarded")]
        assert len(lost) >= max(batched), "their compare-and-swap lost to their own batch"
        assert all(status == 201 for status, _ in first), first
        for key, answer in zip(keys, first, strict=True):
            assert await post(key) == answer, "the first answer is the stored one, replayed"
            assert ledger.count(key) == 1
