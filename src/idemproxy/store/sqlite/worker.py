"""One sqlite3 connection on one thread of its own, and one hop to it per store operation.

sqlite3 blocks, so the connection lives on a dedicated thread, and the store hands it whole
operations: a synchronous function of the connection, which runs there from start to end and
answers the event loop once (a queue put, a thread wake-up, one `call_soon_threadsafe`). A
batch of claims or completions is one such function, however many rows and statements it has.

The thread runs the functions one after the other, so each is atomic with respect to the others:
a transaction begins and ends inside its function (`transact`), and no lock is needed for two
transactions not to interleave. A caller cancelled while its function waits or runs does not
stop it (sqlite3 cannot be interrupted mid-statement without losing the connection's state):
the function is marked abandoned, and the caller's `CancelledError` propagates once it has
ended, its transaction rolled back unless it had already committed. Nothing of it is left for
the next function, and what the caller's claim became is settled by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, TypeVarTuple, Unpack

Result = TypeVar("Result")
Args = TypeVarTuple("Args")


class Abandoned(Exception):
    """The function's caller was cancelled before its transaction committed: rolled back."""


class _Call(Generic[Result]):
    """One function for the thread, and the loop future its caller awaits."""

    __slots__ = ("abandoned", "done", "ended", "loop", "over", "work")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, work: Callable[[_Call[Result]], Result]
    ) -> None:
        self.loop = loop
        self.work = work
        self.done: asyncio.Future[Result] = loop.create_future()
        # Set by the loop when the caller is cancelled; read by the thread before it commits.
        self.abandoned = False
        self.over = False  # on the loop: the thread has answered
        self.ended: asyncio.Future[None] | None = None  # what a cancelled caller waits for

    def __call__(self) -> None:
        """On the thread: run, then answer the loop once, whatever happened."""
        try:
            if self.abandoned:  # cancelled while queued: never started
                raise Abandoned()
            result = self.work(self)
        except BaseException as exc:  # the caller's, raised where it awaits
            self._answer(self._fail, exc)
        else:
            self._answer(self._succeed, result)

    def _answer(self, how: Callable[[Any], None], outcome: object) -> None:
        # A loop closed meanwhile has nobody left to answer; the thread serves the next call.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(how, outcome)

    def _succeed(self, result: Result) -> None:
        if not self.done.done():
            self.done.set_result(result)
        self._over()

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        self._over()

    def _over(self) -> None:
        self.over = True
        if self.ended is not None:
            self.ended.set_result(None)

    async def wait_over(self) -> None:
        """Waits, through further cancellations, until the thread has answered: the function's
        transaction is over (committed or rolled back) before its caller hears of its
        cancellation."""
        if self.over:
            return
        ended = self.ended = self.loop.create_future()
        while not ended.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({ended})


class Worker:
    """The thread that owns the store's connection (`open` makes it, `close` ends it)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None  # touched on the thread only
        self.calls = 0  # functions run: each one hop to the thread

    @property
    def is_open(self) -> bool:
        return self._thread is not None

    async def open(self, path: str, pragmas: list[str]) -> None:
        """Connects on the thread and runs `pragmas`; sqlite3's error if it cannot."""
        self._thread = threading.Thread(target=self._serve, name="idemproxy-sqlite", daemon=True)
        self._thread.start()
        try:
            await self._hop(lambda _call: self._connect(path, pragmas))
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Closes the connection after the functions queued before, and ends the thread."""
        if self._thread is None:
            return
        try:
            with contextlib.suppress(sqlite3.Error):
                await self._hop(lambda _call: self._disconnect())
        finally:  # a cancelled close still ends the thread, after what is queued before it
            self._queue.put(None)
            self._thread = None

    async def run(
        self, fn: Callable[[sqlite3.Connection, Unpack[Args]], Result], *args: *Args
    ) -> Result:
        """`fn(connection, *args)` on the thread, outside a transaction (reads: each statement
        is its own)."""
        return await self._hop(lambda _call: fn(self._connection(), *args))

    async def transact(
        self, fn: Callable[[sqlite3.Connection, Unpack[Args]], Result], *args: *Args
    ) -> Result:
        """`fn(connection, *args)` on the thread in one `BEGIN IMMEDIATE` transaction (the only
        writer from its start: SPEC §11), committed if it returns, rolled back if it raises or
        its caller was cancelled before the commit."""

        def work(call: _Call[Result]) -> Result:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(db, *args)
                if call.abandoned:
                    raise Abandoned()
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            return result

        return await self._hop(work)

    async def _hop(self, work: Callable[[_Call[Result]], Result]) -> Result:
        if self._thread is None:
            raise sqlite3.ProgrammingError("the store's connection is closed")
        call = _Call(asyncio.get_running_loop(), work)
        self.calls += 1
        self._queue.put(call)
        try:
            return await call.done
        except asyncio.CancelledError:
            call.abandoned = True
            await call.wait_over()
            raise

    def _serve(self) -> None:
        while (call := self._queue.get()) is not None:
            call()

    def _connect(self, path: str, pragmas: list[str]) -> None:
        self._conn = sqlite3.connect(path, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        for pragma in pragmas:
            self._conn.execute(pragma)

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.ProgrammingError("the store's connection is closed")
        return self._conn
