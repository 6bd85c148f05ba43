"""The store of record's base: every port of store/ports.py, the metrics hook and the checks
every backend shares (SPEC §11)."""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from types import TracebackType
from typing import Any

from idemproxy.core.types import Job, KeptResponse, SealedResponse, StoredResponse
from idemproxy.errors import ResponseUnreadable, StoreUnavailable
from idemproxy.store.batching import GroupCommit
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
    """A durable home for jobs and attempts, the store of record: every port (store/ports.py)."""

    def __init__(self) -> None:
        self.watch = JobWatch()
        self.observer: Observer | None = None

    def observed(self, operation: str) -> AbstractContextManager[None]:
        """Times the block for `observer`; it failed if it raised StoreUnavailable."""
        return _Observed(self, operation)

    async def lookup(self, owner: str, key: str) -> Job | None:
        return await self.get(owner, key)

    def watching(self, job_id: str) -> AbstractAsyncContextManager[JobWatch.Subscription]:
        return self.watch.subscribe(job_id)

    def opened(self, job: Job, response: KeptResponse) -> StoredResponse:
        """A store with no key ring refuses a sealed response (store/seal/store.py has the
        ring)."""
        if isinstance(response, StoredResponse):
            return response
        raise ResponseUnreadable(missing_key(job, response.key_id))

    def group_commits(self) -> tuple[GroupCommit[Any, Any], ...]:
        """None by default."""
        return ()


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
