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

A statement held up (by a lock another session holds, or a slow server) does not hold up its
group: once the statements in flight have run for `STALL` seconds, the next batch goes out
alongside them, up to `MAX_IN_FLIGHT` statements of a group at once (a request whose job is in
a statement in flight still waits for it, and sees its commit). What a batch's rows get when its
statement fails is the store's: each is retried alone (store/postgres/store.py).

`run` gets the batch and returns one result or exception per request, in order; an exception
it raises is every caller's. Each caller gets exactly its own entry. A caller cancelled while
its request is still queued takes it out of the queue (it never reaches the store); once its
batch of several is in flight the statement runs to its end for the others, and the cancelled
caller's result is dropped (its claim may be committed: proxy/background/unsent.py releases it).
"""

from __future__ import annotations

import asyncio
import functools
import operator
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any, Generic, NamedTuple, TypeAlias, TypeVar

from idemproxy.core.types import Intent, Job, KeptResponse, SealedResponse

Request = TypeVar("Request")
Result = TypeVar("Result")
# Rows per batched claim or completion statement; 1 sends each alone (`pool.store_batch`).
DEFAULT_BATCH = 64
# A request larger than this goes alone; a batch's requests are at most BATCH_BYTES in all.
ALONE_BYTES = 64 * 1024
BATCH_BYTES = 1024 * 1024
# Seconds a group's statements may run before its next batch goes out alongside them, and the
# most statements of one group in flight at once (a store with one connection has 1).
STALL = 0.02
MAX_IN_FLIGHT = 4
# The metrics hook of one kind of write: the rows of each of its statements (SPEC §13).
BatchObserver = Callable[[int], None]


# What `run` gives each request: its result, its error, or a future of either (a row retried
# alone, whose caller gets its answer as soon as it has it, not when the slowest row ends).
Outcome: TypeAlias = Result | BaseException | asyncio.Future[Result]


class _Entry(Generic[Request, Result]):
    __slots__ = ("future", "request")

    def __init__(self, request: Request, future: asyncio.Future[Result]) -> None:
        self.request = request
        self.future = future


class _Group(Generic[Request, Result]):
    """One group's requests: those queued, the statements in flight (each a future that ends
    with it), the jobs they hold (`busy`), and the task that sends the queued ones."""

    __slots__ = ("busy", "drainer", "flights", "queue")

    def __init__(self) -> None:
        self.queue: list[_Entry[Request, Result]] = []
        self.flights: set[asyncio.Future[None]] = set()
        self.busy: set[Hashable] = set()
        self.drainer: asyncio.Task[None] | None = None

    def idle(self) -> bool:
        if self.queue:  # a lone request's group never queued one: no list to rebuild
            self.queue[:] = [entry for entry in self.queue if not entry.future.done()]
        return not self.queue and not self.flights and self.drainer is None


class GroupCommit(Generic[Request, Result]):
    """One kind of write (`claim`, `complete`) of one store, batched per group."""

    def __init__(
        self,
        kind: str,
        run: Callable[[list[Request]], Awaitable[Sequence[Outcome[Result]]]],
        *,
        group: Callable[[Request], Hashable],
        distinct: Callable[[Request], Hashable],
        limit: int,
        size: Callable[[Request], int] | None = None,
    ) -> None:
        """`size`: a request's bytes (None: every request is small)."""
        self.kind = kind
        self.limit = max(1, limit)
        # Statements of one group in flight at once (a store of one connection sets 1), and
        # the seconds they run before the next batch goes out alongside them.
        self.in_flight = MAX_IN_FLIGHT
        self.stall = STALL
        self.observer: BatchObserver | None = None
        self._run = run
        self._group = group
        self._distinct = distinct
        self._size = size
        # How one request goes out by itself, as `run` would send a batch of one: a store
        # that has a statement for one row sets it, so that a lone request (every request of
        # a proxy that is not under load) skips the batch's lists.
        self.alone: Callable[[Request], Awaitable[Result]] = self._run_alone
        self._groups: dict[Hashable, _Group[Request, Result]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, request: Request) -> Result:
        """The request's result. With nothing of its group in flight, the request goes out at
        once, alone, in the caller's own task (a lone request costs no task switch), and
        whatever queues meanwhile follows in one batch; cancelling this caller cancels its
        statement, as without batching. Otherwise it is queued (`_queue`)."""
        if self.limit == 1 or (self._size is not None and self._size(request) > ALONE_BYTES):
            # `pool.store_batch: 1`, or a large request: not batched at all. It is its own
            # statement in its caller's task, concurrently with the others of its group, as
            # without group commit.
            if self.observer is not None:
                self.observer(1)
            return await self.alone(request)
        key = self._group(request)
        group = self._groups.get(key)
        if group is not None:
            return await self._queue(key, group, request)
        group = self._groups[key] = _Group()
        # `_take_off` and `_land` for one request, without their list and generators: this is
        # every claim and completion of a proxy that is not under load.
        distinct = self._distinct(request)
        flight: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        group.flights.add(flight)
        group.busy.add(distinct)
        try:
            if self.observer is not None:
                self.observer(1)
            return await self.alone(request)
        finally:
            group.flights.discard(flight)
            group.busy.discard(distinct)
            flight.set_result(None)
            # `idle`'s test in place for a group nothing joined (no queue to sift).
            if group.queue or group.flights or group.drainer is not None:
                if group.idle() and self._groups.get(key) is group:
                    del self._groups[key]
            elif self._groups.get(key) is group:
                del self._groups[key]

    async def _queue(
        self, key: Hashable, group: _Group[Request, Result], request: Request
    ) -> Result:
        """Behind the group's statements in flight: sent with the next batch (`_drain`)."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        group.queue.append(_Entry(request, future))
        if group.drainer is None:
            group.drainer = self._spawn(self._drain(key, group))
        # A cancelled caller cancels its future: still queued, it is skipped; in flight, its
        # result is dropped. The statement itself is never cancelled for the others' sake.
        return await future

    async def _run_alone(self, request: Request) -> Result:
        [outcome] = await self._run([request])
        if isinstance(outcome, asyncio.Future):
            return await outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def close(self) -> None:
        """Wait for the batches in flight (their callers are waiting for them)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work, name=f"store-{self.kind}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _take_off(
        self, group: _Group[Request, Result], requests: list[Request]
    ) -> asyncio.Future[None]:
        flight: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        group.flights.add(flight)
        group.busy.update(self._distinct(request) for request in requests)
        return flight

    def _land(
        self,
        key: Hashable,
        group: _Group[Request, Result],
        flight: asyncio.Future[None],
        requests: list[Request],
    ) -> None:
        group.flights.discard(flight)
        group.busy.difference_update(self._distinct(request) for request in requests)
        flight.set_result(None)
        if group.idle() and self._groups.get(key) is group:
            del self._groups[key]

    async def _drain(self, key: Hashable, group: _Group[Request, Result]) -> None:
        """Sends the queued requests: as the next batch once a statement of the group ends, or
        alongside those in flight once they have run for `stall` seconds (a statement held up
        by a lock, or a slow one), up to `in_flight` statements at once, so that a slow one
        holds up the requests behind it for no more than `stall`."""
        try:
            while any(not entry.future.done() for entry in group.queue):
                if group.flights:
                    room = len(group.flights) < self.in_flight
                    await asyncio.wait(
                        set(group.flights),
                        timeout=self.stall if room else None,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                batch = self._take(group)
                if not batch:  # each queued request's job is in a statement in flight
                    await asyncio.wait(set(group.flights), return_when=asyncio.FIRST_COMPLETED)
                    continue
                requests = [entry.request for entry in batch]
                flight = self._take_off(group, requests)
                self._spawn(self._fly(key, group, flight, batch))
        except asyncio.CancelledError:  # the drainer itself cancelled (loop shutdown): so are they
            for entry in group.queue:
                entry.future.cancel()
            raise
        finally:
            group.drainer = None
            if group.idle() and self._groups.get(key) is group:
                del self._groups[key]

    async def _fly(
        self,
        key: Hashable,
        group: _Group[Request, Result],
        flight: asyncio.Future[None],
        batch: list[_Entry[Request, Result]],
    ) -> None:
        try:
            await self._send(batch)
        finally:
            self._land(key, group, flight, [entry.request for entry in batch])

    def _take(self, group: _Group[Request, Result]) -> list[_Entry[Request, Result]]:
        """Up to `limit` waiting entries of at most BATCH_BYTES in all (the first whatever its
        size), one per distinct job and none of a job in flight; the rest stay queued, in
        order."""
        batch: list[_Entry[Request, Result]] = []
        seen = set(group.busy)
        left: list[_Entry[Request, Result]] = []
        room = BATCH_BYTES
        for entry in group.queue:
            if entry.future.done():
                continue  # its caller was cancelled before it was sent
            distinct = self._distinct(entry.request)
            size = 0 if self._size is None else self._size(entry.request)
            if len(batch) >= self.limit or distinct in seen or (batch and size > room):
                left.append(entry)
                continue
            seen.add(distinct)
            room -= size
            batch.append(entry)
        group.queue[:] = left
        return batch

    async def _send(self, batch: list[_Entry[Request, Result]]) -> None:
        if self.observer is not None:
            self.observer(len(batch))
        try:
            outcomes = await self._run([entry.request for entry in batch])
        except Exception as exc:  # every caller's error, as it would have been alone
            outcomes = [exc] * len(batch)
        except BaseException:  # the task itself cancelled (loop shutdown): so are they
            for entry in batch:
                entry.future.cancel()
            raise
        later: list[asyncio.Future[Result]] = []
        for entry, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, asyncio.Future):
                outcome.add_done_callback(functools.partial(_answer_from, entry))
                later.append(outcome)
            else:
                _answer(entry, outcome)
        if later:  # the batch stays in flight (its jobs busy) until its last row is answered
            await asyncio.wait(later)


def _answer(entry: _Entry[Request, Result], outcome: Result | BaseException) -> None:
    if entry.future.done():
        return  # its caller was cancelled while the batch was in flight
    if isinstance(outcome, BaseException):
        entry.future.set_exception(outcome)
    else:
        entry.future.set_result(outcome)


def _answer_from(entry: _Entry[Request, Result], done: asyncio.Future[Result]) -> None:
    if done.cancelled():
        if not entry.future.done():
            entry.future.cancel()
        return
    error = done.exception()
    _answer(entry, done.result() if error is None else error)


class ClaimRequest(NamedTuple):
    """One caller's `Store.claim`, as a batch row."""

    intent: Intent
    job_id: str
    upstream: str
    ttl: float
    lease: float
    submitted: float = 0.0  # time.monotonic() when its caller asked; its deadline follows


class CompleteRequest(NamedTuple):
    """One caller's `Store.complete`, as a batch row."""

    job: Job
    attempt: int
    response: KeptResponse
    ttl: float
    submitted: float = 0.0  # as ClaimRequest's


# Which group and which job or key a request is: read by the C-level attrgetter, not a Python
# function of their own (one call less per claim and per completion).
claim_group: Callable[[ClaimRequest], str] = operator.attrgetter("intent.owner")
claim_distinct: Callable[[ClaimRequest], str] = operator.attrgetter("intent.key")
complete_group: Callable[[CompleteRequest], str] = operator.attrgetter("job.owner")
complete_distinct: Callable[[CompleteRequest], str] = operator.attrgetter("job.id")


def complete_size(request: CompleteRequest) -> int:
    """The bytes a completion's row carries, near enough: its body (or sealed box) and headers."""
    response = request.response
    if isinstance(response, SealedResponse):
        return len(response.sealed)
    size = 0 if response.body is None else len(response.body)
    for name, value in response.headers:
        size += len(name) + len(value)
    return size
