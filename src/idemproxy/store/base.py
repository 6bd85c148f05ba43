"""The store of record's base: every port of store/ports.py, the metrics hook and the checks
every backend shares (SPEC §11)."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from types import TracebackType
from typing import Any

from idemproxy.core.types import Job, JobState, KeptResponse, SealedResponse, StoredResponse
from idemproxy.errors import ResponseUnreadable, StoreUnavailable
from idemproxy.store.batching import GroupCommit
from idemproxy.store.hooks import Change, ChangeHook, ResponseSeal
from idemproxy.store.ports import (
    AttemptFailure,
    Housekeeping,
    JobStore,
    LateResponse,
    Lifecycle,
    Observer,
    Operators,
    Resealing,
)
from idemproxy.store.watch import JobWatch

__all__ = ["AttemptFailure", "LateResponse", "Store", "key_of", "missing_key"]


def missing_key(job: Job, key_id: str) -> str:
    """The detail of a response sealed with a key the ring does not hold (SPEC §11)."""
    if not key_id:
        return (
            f"The stored response of job {job.id} has neither headers in the clear nor a key "
            "id: it was altered; the request was not forwarded."
        )
    return (
        f"The stored response of job {job.id} is sealed with key {key_id!r}, which is not in "
        "the proxy's key ring; the request was not forwarded."
    )


def key_of(response: KeptResponse | None) -> str | None:
    """The id of the key `response` is sealed with; None in the clear, or for a box whose key
    id was cleared (rows.py `NO_KEY_ID`), as its column holds."""
    return response.key_id or None if isinstance(response, SealedResponse) else None


class Store(JobStore, Operators, Housekeeping, Resealing, Lifecycle):
    """A durable home for jobs and attempts, the store of record: every port (store/ports.py).

    The layers in front of its hot path (store/layers.py) learn of the changes the other
    interfaces make through `hooks`, and the seal of responses (`seal`) applies to them too:
    an operator's resolution, deletion and resealing reach this store directly, not through
    the layers. A backend implements the statements (`_resolve`, `_delete`, `_reseal`); this
    class calls the hooks around them.
    """

    def __init__(self) -> None:
        self.watch = JobWatch()
        self.observer: Observer | None = None
        # The durations of claims and completions that did not fail, every new key's two
        # calls: each the `store_seconds` series' own append (observe/metrics.py), one C call
        # rather than `observer`. None: each goes to `observer` as the other calls do.
        self.claim_seconds: Callable[[float], None] | None = None
        self.complete_seconds: Callable[[float], None] | None = None
        # Replay caches in front, in the order they were put there (innermost first).
        self.hooks: list[ChangeHook] = []
        # The key ring's codec when responses are sealed at rest (SPEC §11), else None.
        self.seal: ResponseSeal | None = None

    def observed(self, operation: str) -> AbstractContextManager[None]:
        """Times the block for `observer`; it failed if it raised StoreUnavailable."""
        return _Observed(self, operation)

    async def lookup(self, owner: str, key: str) -> Job | None:
        return await self.get(owner, key)

    def watching(self, job_id: str) -> AbstractAsyncContextManager[JobWatch.Subscription]:
        return self.watch.subscribe(job_id)

    def opened(self, job: Job, response: KeptResponse) -> StoredResponse:
        """With no key ring, a sealed response does not open (SPEC §11)."""
        if self.seal is not None:
            return self.seal.open(job, response)
        if isinstance(response, StoredResponse):
            return response
        raise ResponseUnreadable(missing_key(job, response.key_id))

    def group_commits(self) -> tuple[GroupCommit[Any, Any], ...]:
        """None by default."""
        return ()

    # --- the writes every replay cache must learn of ---------------------------------------------

    async def resolve(
        self,
        job: Job,
        state: JobState,
        *,
        response: KeptResponse | None = None,
        ttl: float = 0.0,
        resolution: str = "operator",
    ) -> bool:
        if response is not None and self.seal is not None:
            response = self.seal.seal(job, response)  # SPEC §11: before any layer keeps it
        won = await self._resolve(job, state, response=response, ttl=ttl, resolution=resolution)
        for hook in self.hooks:
            hook.changed(job, Change.RESOLVED, won)
        return won

    async def delete(self, job: Job, *, force: bool = False) -> bool:
        for hook in reversed(self.hooks):  # the outermost first, as a call through them went
            await hook.deleting(job)
        won = False
        try:
            won = await self._delete(job, force=force)
        finally:  # failed too: a read under way meanwhile may predate the deletion
            for hook in self.hooks:
                hook.changed(job, Change.DELETED, won)
        return won

    async def reseal(self, job: Job, sealed: SealedResponse) -> bool:
        won = await self._reseal(job, sealed)
        for hook in self.hooks:
            hook.changed(job, Change.RESEALED, won)
        return won

    @abc.abstractmethod
    async def _resolve(
        self,
        job: Job,
        state: JobState,
        *,
        response: KeptResponse | None,
        ttl: float,
        resolution: str,
    ) -> bool:
        """`resolve`'s statement, `response` as it is to be kept."""

    @abc.abstractmethod
    async def _delete(self, job: Job, *, force: bool) -> bool:
        """`delete`'s statement."""

    @abc.abstractmethod
    async def _reseal(self, job: Job, sealed: SealedResponse) -> bool:
        """`reseal`'s statement."""


class _Observed(AbstractContextManager[None]):
    """`Store.observed` as a plain class: a generator-based context manager costs a generator
    and two extra frames on every store call."""

    __slots__ = ("_operation", "_started", "_store")

    def __init__(self, store: Store, operation: str) -> None:
        self._store = store
        self._operation = operation
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        observer = self._store.observer
        if observer is not None:
            failed = exc_type is not None and issubclass(exc_type, StoreUnavailable)
            observer(self._operation, time.perf_counter() - self._started, failed)
