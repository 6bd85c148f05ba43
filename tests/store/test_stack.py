"""The layers in front of the hot path and the store of record behind them (store/layers.py):
which layers a call crosses, the order the stack opens and closes in, and the hooks through
which a layer learns of the operators' changes (store.hooks.ChangeHook)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from idemproxy.core.types import (
    Claimed,
    ClaimResult,
    Intent,
    Job,
    JobState,
    KeptResponse,
    StoredResponse,
)
from idemproxy.errors import StoreUnavailable
from idemproxy.proxy.background.orphans import take_over_orphans
from idemproxy.store.base import Store
from idemproxy.store.hooks import Change
from idemproxy.store.layers import JobLayer, StoreStack
from idemproxy.store.sqlite.store import SqliteStore
from tests.support.keyring import OLD, codec

RESPONSE = StoredResponse(201, (), b"done")
Event = tuple[str, ...]


class Recording(JobLayer):
    """A layer that acts on completions only, and records what it is told."""

    def __init__(self, inner: Store | JobLayer, name: str, events: list[Event]) -> None:
        super().__init__(inner)
        self.name = name
        self.events = events
        self.record.hooks.append(self)

    async def open(self) -> None:
        self.events.append((self.name, "open"))

    async def close(self) -> None:
        self.events.append((self.name, "close"))

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        self.events.append((self.name, "complete"))
        return await self.inner.complete(job, attempt, response, ttl=ttl)

    async def deleting(self, job: Job) -> None:
        self.events.append((self.name, "deleting"))

    def changed(self, job: Job, change: Change, won: bool) -> None:
        self.events.append((self.name, change.value, str(won)))


class Claims(JobLayer):
    """A layer that acts on claims only."""

    def __init__(self, inner: Store | JobLayer, events: list[Event]) -> None:
        super().__init__(inner)
        self.events = events

    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        self.events.append(("claims", "claim"))
        return await self.inner.claim(intent, job_id, upstream, ttl=ttl, lease=lease)


@pytest.fixture
async def record(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    store = SqliteStore(str(tmp_path / "stack.db"))
    await store.open()
    try:
        await store.migrate()
        yield store
    finally:
        await store.close()


async def _unknown(stack: StoreStack, key: str = "k1") -> Job:
    intent = Intent("alice", key, "fp", "POST", "/pay")
    claimed = await stack.jobs.claim(intent, str(uuid.uuid4()), "primary", ttl=60, lease=30)
    assert isinstance(claimed, Claimed)
    assert await stack.jobs.settle(claimed.job, 1, JobState.UNKNOWN, error="timed out")
    job = await stack.record.get_by_id(claimed.job.id)
    assert job is not None
    return job


def test_a_call_crosses_only_the_layers_that_act_on_it(record: SqliteStore) -> None:
    events: list[Event] = []
    inner = Recording(record, "inner", events)
    outer = Claims(inner, events)
    assert outer.claim.__self__ is outer  # type: ignore[attr-defined]
    assert outer.complete.__self__ is inner
    for name in ("renew_lease", "settle", "take_over", "delete", "opened", "watching"):
        assert getattr(outer, name).__self__ is record, name
    assert StoreStack.of(outer).record is record and outer.watch is record.watch


async def test_a_new_key_goes_through_each_layer_that_acts_on_it_once(
    record: SqliteStore,
) -> None:
    events: list[Event] = []
    stack = StoreStack.of(Claims(Recording(record, "inner", events), events))
    intent = Intent("alice", "k1", "fp", "POST", "/pay")
    claimed = await stack.jobs.claim(intent, str(uuid.uuid4()), "primary", ttl=60, lease=30)
    assert isinstance(claimed, Claimed)
    assert await stack.jobs.complete(claimed.job, 1, RESPONSE, ttl=60)
    assert events == [("claims", "claim"), ("inner", "complete")]


async def test_the_stack_opens_the_record_first_and_closes_it_last(tmp_path: Path) -> None:
    events: list[Event] = []
    record = SqliteStore(str(tmp_path / "order.db"))
    stack = StoreStack.of(Recording(Recording(record, "inner", events), "outer", events))
    await stack.open()
    await record.ping()  # open before its layers
    await stack.close()
    assert events == [("inner", "open"), ("outer", "open"), ("outer", "close"), ("inner", "close")]
    with pytest.raises(StoreUnavailable):
        await record.ping()
    assert [layer.name for layer in stack.layers() if isinstance(layer, Recording)] == [
        "outer",
        "inner",
    ]
    assert stack.layer(Claims) is None


async def test_an_operators_deletion_tells_every_layer_before_and_after(
    record: SqliteStore,
) -> None:
    events: list[Event] = []
    stack = StoreStack.of(Recording(Recording(record, "inner", events), "outer", events))
    job = await _unknown(stack)
    events.clear()
    assert await stack.record.delete(job)
    assert not await stack.record.delete(job)  # gone already: told all the same
    told = [
        ("outer", "deleting"),
        ("inner", "deleting"),
        ("inner", "deleted"),
        ("outer", "deleted"),
    ]
    assert [event[:2] for event in events] == told * 2
    assert [event[2] for event in events if len(event) == 3] == ["True", "True", "False", "False"]


async def test_a_deletion_that_failed_is_told_too(tmp_path: Path) -> None:
    """A read under way while it failed may predate a deletion that committed after all."""
    events: list[Event] = []
    record = SqliteStore(str(tmp_path / "gone.db"))
    stack = StoreStack.of(Recording(record, "cache", events))
    await stack.open()
    await record.migrate()
    job = await _unknown(stack)
    await stack.close()
    events.clear()
    with pytest.raises(StoreUnavailable):
        await record.delete(job)
    assert events == [("cache", "deleting"), ("cache", "deleted", "False")]


async def test_resolutions_and_reseals_are_told_with_whether_they_won(
    record: SqliteStore,
) -> None:
    events: list[Event] = []
    stack = StoreStack.of(Recording(record, "cache", events))
    job = await _unknown(stack)
    events.clear()
    assert await record.resolve(job, JobState.COMPLETED, response=RESPONSE, ttl=60)
    assert not await record.resolve(job, JobState.RELEASED)  # a stale version loses
    done = await record.get_by_id(job.id)
    assert done is not None and done.response is not None
    ring = codec(OLD)
    box = ring.reseal(done, done.response)
    assert box is not None and await record.reseal(done, box)
    assert events == [
        ("cache", "resolved", "True"),
        ("cache", "resolved", "False"),
        ("cache", "resealed", "True"),
    ]


async def test_the_record_seals_an_operators_resolution_with_its_ring(
    record: SqliteStore,
) -> None:
    stack = StoreStack.of(record)
    job = await _unknown(stack)
    record.seal = ring = codec(OLD)
    assert await record.resolve(job, JobState.COMPLETED, response=RESPONSE, ttl=60)
    done = await record.get_by_id(job.id)
    assert done is not None and done.response is not None
    assert done.response != RESPONSE and ring.open(done, done.response) == RESPONSE
    assert record.opened(done, done.response) == RESPONSE


class Takeovers(JobLayer):
    """A layer that acts on takeovers only (as the Redis cache announces them)."""

    def __init__(self, inner: Store | JobLayer) -> None:
        super().__init__(inner)
        self.taken: list[str] = []

    async def take_over(self, job: Job) -> bool:
        self.taken.append(job.id)
        return await self.inner.take_over(job)


async def test_the_background_takeover_goes_through_the_hot_paths_layers(
    record: SqliteStore,
) -> None:
    """SPEC §3.5: an orphan taken over in the background is announced as a request's takeover
    is; the expired leases are read from the store of record."""
    layer = Takeovers(record)
    intent = Intent("alice", "orphan", "fp", "POST", "/pay")
    claimed = await layer.claim(intent, str(uuid.uuid4()), "primary", ttl=60, lease=0.05)
    assert isinstance(claimed, Claimed)
    await asyncio.sleep(0.3)
    assert await take_over_orphans(record, layer, older_than=0.1, batch_size=10) == 1
    assert layer.taken == [claimed.job.id]
