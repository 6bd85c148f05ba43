"""Group commit: concurrent writes of one kind go out as one statement and one durable commit.

A request's claim (or completion) that finds no statement of its group in flight goes out at
once, alone, in its caller's task. Requests that arrive while one is in flight are queued, and
go out together as the next statement once it ends, up to `limit` of them: nothing waits for a
batch to fill, so a lone request's latency is unchanged, and under load each commit (each WAL
flush or fsync) serves many requests.

A group is one owner: every row of a batch has the same owner, so that the statement still names
`owner` as a parameter and is routed to one shard (SPEC §11). Two requests for the same job or
key never share a batch (`distinct`): the second goes out in the next one and sees the first's
commit, as it would have alone.

A batch is bounded by bytes as well as rows, so that no statement carries much more than one
request would alone (a statement's time grows with its bytes, and it has one request's timeout,
`pool.store_timeout`): a request of more than `ALONE_BYTES` (a completion's body) is never
batched, it goes out at once in its caller's task, concurrently, as without batching; and the
rows of one batch carry at most `BATCH_BYTES` in all.

`run` gets the batch and returns one result or exception per request, in order; an exception
it raises is every caller's. Each caller gets exactly its own entry. A caller cancelled while
its request is still queued takes it out of the queue (it never reaches the store); once its
batch of several is in flight the statement runs to its end for the others, and the cancelled
caller's result is dropped (its claim may be committed: proxy/background/unsent.py releases it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, NamedTuple, TypeVar

from idemproxy.core.types import Intent, Job, KeptResponse, SealedResponse

Request = TypeVar("Request")
Result = TypeVar("Result")
# Rows per batched claim or completion statement; 1 sends each alone (`pool.store_batch`).
DEFAULT_BATCH = 64
# A request larger than this goes alone; a batch's requests are at most BATCH_BYTES in all.
ALONE_BYTES = 64 * 1024
BATCH_BYTES = 1024 * 1024
# The metrics hook: (kind, rows in the statement), for every batch sent (SPEC §13).
BatchObserver = Callable[[str, int], None]


class _Entry(Generic[Request, Result]):
    __slots__ = ("future", "request")

    def __init__(self, request: Request, future: asyncio.Future[Result]) -> None:
        self.request = request
        self.future = future


class GroupCommit(Generic[Request, Result]):
    """One kind of write (`claim`, `complete`) of one store, batched per group."""

    def __init__(
        self,
        kind: str,
        run: Callable[[list[Request]], Awaitable[Sequence[Result | BaseException]]],
        *,
        group: Callable[[Request], Hashable],
        distinct: Callable[[Request], Hashable],
        limit: int,
        size: Callable[[Request], int] = lambda _request: 0,
    ) -> None:
        self.kind = kind
        self.limit = max(1, limit)
        self.observer: BatchObserver | None = None
        self._run = run
        self._group = group
        self._distinct = distinct
        self._size = size
        self._queues: dict[Hashable, list[_Entry[Request, Result]]] = {}
        self._drainers: set[asyncio.Task[None]] = set()

    async def submit(self, request: Request) -> Result:
        if self.limit == 1 or self._size(request) > ALONE_BYTES:
            # `pool.store_batch: 1`, or a large request: not batched at all. It is its own
            # statement in its caller's task, concurrently with the others of its group, as
            # without group commit.
            return await self._alone(request)
        group = self._group(request)
        queue = self._queues.get(group)
        if queue is None:
            return await self._lead(group, request)
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        queue.append(_Entry(request, future))
        # A cancelled caller cancels its future: still queued, it is skipped; in flight, its
        # result is dropped. The statement itself is never cancelled for the others' sake.
        return await future

    async def _lead(self, group: Hashable, request: Request) -> Result:
        """Nothing of the group in flight: this request goes out at once, in the caller's own
        task (a lone request costs no task switch), and whatever queues meanwhile follows in
        one batch. Cancelling this caller cancels its statement, as without batching."""
        queue: list[_Entry[Request, Result]] = []
        self._queues[group] = queue
        try:
            if self.observer is not None:
                self.observer(self.kind, 1)
            [outcome] = await self._run([request])
        finally:
            if queue:
                drainer = asyncio.create_task(self._drain(group, queue), name=f"store-{self.kind}")
                self._drainers.add(drainer)
                drainer.add_done_callback(self._drainers.discard)
            else:
                del self._queues[group]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def _alone(self, request: Request) -> Result:
        if self.observer is not None:
            self.observer(self.kind, 1)
        [outcome] = await self._run([request])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def close(self) -> None:
        """Wait for the batches in flight (their callers are waiting for them)."""
        while self._drainers:
            await asyncio.gather(*self._drainers, return_exceptions=True)

    async def _drain(self, group: Hashable, queue: list[_Entry[Request, Result]]) -> None:
        try:
            while batch := self._take(queue):
                await self._send(batch)
        finally:
            del self._queues[group]
            for entry in queue:  # only when the drainer itself was cancelled (loop shutdown)
                if not entry.future.done():
                    entry.future.cancel()

    def _take(self, queue: list[_Entry[Request, Result]]) -> list[_Entry[Request, Result]]:
        """Up to `limit` waiting entries of at most BATCH_BYTES in all (the first whatever its
        size), one per distinct job; the rest stay queued, in order."""
        batch: list[_Entry[Request, Result]] = []
        seen: set[Hashable] = set()
        left: list[_Entry[Request, Result]] = []
        room = BATCH_BYTES
        for entry in queue:
            if entry.future.done():
                continue  # its caller was cancelled before it was sent
            distinct = self._distinct(entry.request)
            size = self._size(entry.request)
            if len(batch) >= self.limit or distinct in seen or (batch and size > room):
                left.append(entry)
                continue
            seen.add(distinct)
            room -= size
            batch.append(entry)
        queue[:] = left
        return batch

    async def _send(self, batch: list[_Entry[Request, Result]]) -> None:
        if self.observer is not None:
            self.observer(self.kind, len(batch))
        try:
            outcomes = await self._run([entry.request for entry in batch])
        except Exception as exc:  # every caller's error, as it would have been alone
            outcomes = [exc] * len(batch)
        except BaseException:  # the drainer itself cancelled (loop shutdown): so are they
            for entry in batch:
                entry.future.cancel()
            raise
        for entry, outcome in zip(batch, outcomes, strict=True):
            if entry.future.done():
                continue
            if isinstance(outcome, BaseException):
                entry.future.set_exception(outcome)
            else:
                entry.future.set_result(outcome)


class ClaimRequest(NamedTuple):
    """One caller's `Store.claim`, as a batch row."""

    intent: Intent
    job_id: str
    upstream: str
    ttl: float
    lease: float


class CompleteRequest(NamedTuple):
    """One caller's `Store.complete`, as a batch row."""

    job: Job
    attempt: int
    response: KeptResponse
    ttl: float


def claim_group(request: ClaimRequest) -> str:
    return request.intent.owner


def claim_distinct(request: ClaimRequest) -> str:
    return request.intent.key


def complete_group(request: CompleteRequest) -> str:
    return request.job.owner


def complete_distinct(request: CompleteRequest) -> str:
    return request.job.id


def complete_size(request: CompleteRequest) -> int:
    """The bytes a completion's row carries, near enough: its body (or sealed box) and headers."""
    response = request.response
    if isinstance(response, SealedResponse):
        return len(response.sealed)
    headers = sum(len(name) + len(value) for name, value in response.headers)
    return headers + (0 if response.body is None else len(response.body))
