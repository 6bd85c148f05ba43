"""Layers in front of the hot path of the store of record, and the stack they make (SPEC §11).

A replay cache (store/cache/memory.py, store/redis/cache.py) or the sealing of responses
(store/seal/store.py) is a `JobLayer`: it wraps `JobStore`, the request path's interface, and
nothing else. The operators, housekeeping and resealing reach the store of record directly;
what a layer must learn of their changes, it learns through the record's hooks
(`store.hooks.ChangeHook`), and the record seals and opens with the same key ring as the
sealing layer (store/factory.py `wrap_with_seal`).

A call a layer adds nothing to does not pass through it: each layer binds the methods it does
not override straight to the next layer (or store) that does, once, when it is built, so that
a new key's claim crosses only the caches that answer claims.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias, TypeVar

from idemproxy.core.quota import QuotaLimits
from idemproxy.core.types import (
    Claimed,
    ClaimResult,
    Evidence,
    Intent,
    Job,
    JobState,
    KeptResponse,
    StoredResponse,
)
from idemproxy.store.base import Store
from idemproxy.store.hooks import Change
from idemproxy.store.ports import AttemptFailure, JobStore, Observer
from idemproxy.store.watch import JobWatch

# Every method of `JobStore` (store/ports.py), which a layer hands to the one behind it unless
# it overrides it.
HOT_PATH = (
    "claim",
    "claim_within",
    "get",
    "lookup",
    "watch_job",
    "watching",
    "complete",
    "settle",
    "finish_attempt",
    "start_next_attempt",
    "fail_over",
    "add_attempt",
    "renew_lease",
    "take_over",
    "forget",
    "delete",
    "resend",
    "note_sent",
    "get_by_id",
    "record_evidence",
    "opened",
)


class JobLayer(JobStore):
    """A layer in front of `inner` (the store of record, or another layer). It shares the
    record's `watch` (one set of waiters, woken by every feed) and its metrics hook."""

    def __init__(self, inner: Store | JobLayer) -> None:
        self.inner: Store | JobLayer = inner
        self.record: Store = inner.record if isinstance(inner, JobLayer) else inner
        self.watch: JobWatch = self.record.watch
        for name in HOT_PATH:
            if getattr(type(self), name) is getattr(JobLayer, name):
                setattr(self, name, getattr(inner, name))  # this layer is skipped

    @property
    def observer(self) -> Observer | None:
        """The record's metrics hook, for what a layer times itself (a Redis lookup)."""
        return self.record.observer

    async def open(self) -> None:
        """What the layer starts once the store of record is open; nothing by default."""

    async def close(self) -> None:
        """What the layer stops before the store of record closes; nothing by default."""

    # What a layer does with a call it does not override: hands it on (bound away above).

    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        return await self.inner.claim(intent, job_id, upstream, ttl=ttl, lease=lease)

    async def claim_within(
        self,
        intent: Intent,
        job_id: str,
        upstream: str,
        *,
        ttl: float,
        lease: float,
        limits: QuotaLimits,
    ) -> ClaimResult | str:
        return await self.inner.claim_within(
            intent, job_id, upstream, ttl=ttl, lease=lease, limits=limits
        )

    async def get(self, owner: str, key: str) -> Job | None:
        return await self.inner.get(owner, key)

    async def lookup(self, owner: str, key: str) -> Job | None:
        return await self.inner.lookup(owner, key)

    async def watch_job(self, owner: str, key: str) -> Job | None:
        return await self.inner.watch_job(owner, key)

    def watching(self, job_id: str) -> AbstractAsyncContextManager[JobWatch.Subscription]:
        return self.inner.watching(job_id)

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        return await self.inner.complete(job, attempt, response, ttl=ttl)

    async def settle(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> bool:
        return await self.inner.settle(job, attempt, state, status=status, error=error)

    async def finish_attempt(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> None:
        await self.inner.finish_attempt(job, attempt, state, status=status, error=error)

    async def start_next_attempt(
        self, job: Job, upstream: str, *, lease: float, token: str | None = None
    ) -> Claimed | None:
        return await self.inner.start_next_attempt(job, upstream, lease=lease, token=token)

    async def fail_over(
        self,
        job: Job,
        attempt: int,
        upstream: str,
        *,
        failure: AttemptFailure,
        lease: float,
        token: str | None = None,
    ) -> Claimed | None:
        return await self.inner.fail_over(
            job, attempt, upstream, failure=failure, lease=lease, token=token
        )

    async def add_attempt(self, job: Job, upstream: str, *, lease: float) -> int | None:
        return await self.inner.add_attempt(job, upstream, lease=lease)

    async def renew_lease(self, job: Job, *, lease: float) -> bool:
        return await self.inner.renew_lease(job, lease=lease)

    async def take_over(self, job: Job) -> bool:
        return await self.inner.take_over(job)

    async def forget(self, job: Job) -> bool:
        return await self.inner.forget(job)

    async def delete(self, job: Job, *, force: bool = False) -> bool:
        return await self.inner.delete(job, force=force)

    async def resend(
        self, job: Job, attempt: int, upstream: str, *, window: float, lease: float, token: str
    ) -> Claimed | None:
        return await self.inner.resend(
            job, attempt, upstream, window=window, lease=lease, token=token
        )

    async def note_sent(self, job: Job, attempt: int, digest: str) -> None:
        await self.inner.note_sent(job, attempt, digest)

    async def get_by_id(self, job_id: str) -> Job | None:
        return await self.inner.get_by_id(job_id)

    async def record_evidence(self, job: Job, attempt: int, evidence: Evidence) -> None:
        await self.inner.record_evidence(job, attempt, evidence)

    def opened(self, job: Job, response: KeptResponse) -> StoredResponse:
        return self.inner.opened(job, response)


Layer = TypeVar("Layer", bound=JobLayer)
# The store of record with its layers in front, given by the outermost (or the record alone).
Stacked: TypeAlias = Store | JobLayer


class Reread(NamedTuple):
    """What the store of record holds under the key of a job whose response, read through the
    caches, did not open; every cache has dropped its copy."""

    job: Job | None  # None: no job, so the request is claimed as new (SPEC §11)


Rereader: TypeAlias = Callable[[Job, KeptResponse], Awaitable[Reread | None]]


def record_reread(top: JobStore) -> Rereader | None:
    """For a job whose response, read through the caches in front of the store of record, did
    not open (SPEC §11): the record's job when its response is another, or no job when it has
    none (the caches then drop their copies), else None: the record's own copy did not open.
    None when no cache stands in front: the copy was the record's."""
    record = top.record if isinstance(top, JobLayer) else None
    if record is None:
        return None

    async def reread(job: Job, unopened: KeptResponse) -> Reread | None:
        if not record.hooks:
            return None
        fresh = await record.get(job.owner, job.key)
        if fresh is None:
            # An entry for a job the record does not hold (planted, or a deleted job's put
            # back): dropped and tombstoned as a deleted job's is, before the claim that
            # follows reads the caches again.
            for cache in reversed(record.hooks):
                await cache.deleting(job)
            return Reread(None)
        if fresh.response == unopened:
            return None  # the record's own copy: nothing better to answer with
        for cache in record.hooks:
            cache.changed(job, Change.UNREADABLE, True)
        return Reread(fresh)

    return reread


@dataclass(frozen=True, slots=True)
class StoreStack:
    """One process's store: the hot path through its layers (`jobs`), everything else on the
    store of record (`record`: the operators, housekeeping, resealing, the lifecycle)."""

    top: Stacked
    record: Store

    @classmethod
    def of(cls, top: Stacked) -> StoreStack:
        return cls(top, top.record if isinstance(top, JobLayer) else top)

    @property
    def jobs(self) -> JobStore:
        """The hot path, through every layer."""
        return self.top

    def layers(self) -> Iterator[JobLayer]:
        """The layers, outermost first."""
        layer: JobStore = self.top
        while isinstance(layer, JobLayer):
            yield layer
            layer = layer.inner

    def layer(self, kind: type[Layer]) -> Layer | None:
        """The first layer of type `kind`, if any."""
        return next((layer for layer in self.layers() if isinstance(layer, kind)), None)

    async def open(self) -> None:
        """The store of record, then the layers from the innermost out."""
        await self.record.open()
        for layer in reversed(list(self.layers())):
            await layer.open()

    async def close(self) -> None:
        for layer in self.layers():
            await layer.close()
        await self.record.close()
