"""Reading a governed response body for storing, within the response budget (`ResponseBudget`,
below).

Up to `max_stored_body` bytes are read before the client sees one (the outcome is stored first,
SPEC §2 step 4). They stay in memory while the budget has room; once it has none, what was read
so far and the rest go to an unnamed temporary file (as nginx's `proxy_temp_path` does), so that
the upstream connection is read at full speed and the response is still stored and answered
whole. Such a body is read back into memory for its store write once the budget has room, or
after `limits.response_buffer_wait` over it (`ResponseBudget.take`), and its client is answered
from the file.

The response budget: one per process, for the response bytes it holds in memory
(`limits.response_buffer`).

Each governed response of up to `max_stored_body` is read whole before it is stored (SPEC §2
step 4, §7); without a bound, two hundred 8 MiB answers at once hold 1.6 GB. Bytes are taken
from the budget as they are read (`try_take`, which never waits: a body that does not fit goes
to a temporary file instead, `Captured`) and given back once they are written to the
client. A body on disk is read back into memory for its store write with `take`, which waits,
first come first served, until the budget has room. Only a caller that holds nothing waits, so
waiting cannot deadlock; a body larger than the whole budget is let through when nothing else
is held, so that it is stored rather than refused (the bound is then that body's size).

The budget never makes a request wait without bound (SPEC §9: never a reason to stall or refuse
a request): `take` waits at most `limits.response_buffer_wait`, then goes over the budget (an
overdraft, counted and logged), and a response being written to its client holds its bytes for
at most `limits.response_buffer_hold` (proxy/server/connection.py). A client that does not read can
then
make the process hold more than the budget for a while, never freeze the answers of others.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO, Protocol

from aiohttp import web
from multidict import CIMultiDict

from idemproxy.proxy.server.connection import (
    ONE_WRITE_BODY,
    AsSentResponse,
    AsSentStreamResponse,
    NotifiedResponse,
)
from idemproxy.proxy.server.sink import ClientSink

log = logging.getLogger(__name__)
_LOG_EVERY = 60.0  # seconds between two log lines about overdrafts


class ResponseBudget:
    def __init__(
        self,
        limit: int,
        *,
        wait: float = 1.0,
        hold: float = 10.0,
        overdrawn: Callable[[], None] | None = None,
    ) -> None:
        self.limit = limit
        self.wait = wait  # the longest `take` waits for room
        self.hold = hold  # the longest a response being written holds its bytes
        self.used = 0
        self.overdrafts = 0
        self._overdrawn = overdrawn
        self._logged_at = -_LOG_EVERY
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def try_take(self, size: int) -> bool:
        """Take `size` bytes if they fit now and nobody waits for room before us."""
        if self._waiting or self.used + size > self.limit:
            return False
        self.used += size
        return True

    async def take(self, size: int) -> None:
        """Take `size` bytes, waiting for room first, at most `wait` seconds: then they are
        taken over the budget. The caller must hold nothing else."""
        if not self._waiting and self._fits(size):
            self.used += size
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.append((size, granted))
        try:
            # asyncio.wait, not a timeout: the future is left as it is when the time is up.
            await asyncio.wait((granted,), timeout=self.wait)
        except asyncio.CancelledError:
            if granted.done():
                self.give_back(size)  # granted just as the caller was cancelled
            else:
                granted.cancel()
                self._wake()  # the next in line may fit now that this one left
            raise
        if granted.done():
            return
        granted.cancel()  # left in the queue, skipped by _wake
        self.overdraw(size)

    def overdraw(self, size: int) -> None:
        """Take `size` bytes whether or not they fit: held for a bounded time, they are a
        softer bound than a request that waits for ever."""
        self.used += size
        self.overdrafts += 1
        if self._overdrawn is not None:
            self._overdrawn()
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY:
            self._logged_at = now
            log.warning(
                "response buffer full: %d bytes taken over limits.response_buffer (%d) after "
                "waiting %.1fs (%d such overdrafts so far); a client may not be reading",
                size,
                self.limit,
                self.wait,
                self.overdrafts,
            )
        self._wake()

    def give_back(self, size: int) -> None:
        self.used -= size
        if self._waiting:  # nobody waits for room: no call
            self._wake()

    def _fits(self, size: int) -> bool:
        return self.used == 0 or self.used + size <= self.limit

    def _wake(self) -> None:
        while self._waiting:
            size, granted = self._waiting[0]
            if granted.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            if not self._fits(size):
                return
            self._waiting.popleft()
            self.used += size
            granted.set_result(None)


class Held:
    """Bytes taken from a budget, given back exactly once (by whoever finishes first)."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: ResponseBudget, size: int = 0) -> None:
        self._budget = budget
        self.size = size

    def add(self, size: int) -> bool:
        if not self._budget.try_take(size):
            return False
        self.size += size
        return True

    def release(self) -> None:
        size, self.size = self.size, 0
        if size:
            self._budget.give_back(size)


_PIECE = 256 * 1024  # read back from a temporary file in pieces of this size


class BodySource(Protocol):
    """What is read here of an upstream response (proxy/upstream/client.py's `UpstreamResponse`)."""

    async def read_chunk(self) -> bytes:
        """The next piece of the body; b"" once it is complete."""
        ...

    async def read_piece(self) -> tuple[bytes, bool]:
        """The next piece of the body, and whether it was the last; (b"", True) once it is
        complete."""
        ...


class Captured:
    """Up to `limit` bytes of an upstream body, in memory or on disk; `whole` when that was
    all of it. Whoever holds it gives its bytes back (`release`, `close`, or the response
    `answer` makes of it) on every path: no finalizer per response on the hot path."""

    def __init__(self, budget: ResponseBudget) -> None:
        self._budget = budget
        self.held = Held(budget)
        self._chunks: list[bytes] = []
        self._spool: BinaryIO | None = None
        # The body while it is one bytes object in memory (nearly every body: one piece, or
        # joined); None in pieces or on disk. A field, where `content` is a call.
        self.memory: bytes | None = b""
        self.size = 0
        self.whole = False

    @property
    def budget_hold(self) -> float:
        return self._budget.hold

    @property
    def spooled(self) -> bool:
        return self._spool is not None

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._spool is None and self.held.add(len(chunk)):
            self._chunks.append(chunk)
            self.memory = chunk if len(self._chunks) == 1 else None
            return
        self._spill()
        assert self._spool is not None
        self._spool.write(chunk)

    def _spill(self) -> None:
        if self._spool is not None:
            return
        spool = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close() or the finalizer
        weakref.finalize(self, spool.close)
        for chunk in self._chunks:
            spool.write(chunk)
        self._spool, self._chunks, self.memory = spool, [], None
        self.held.release()

    def in_memory(self) -> bytes | None:
        """The body as one bytes object when it is in memory; None when it is on disk."""
        if self._spool is None and len(self._chunks) > 1:
            self._join()
        if self._spool is not None:
            return None
        return self._chunks[0] if self._chunks else b""

    async def content(self) -> bytes:
        """The body in memory, held against the budget until `release` (for its store write and
        a contract check). A spooled body waits for room first."""
        if self.memory is not None:  # `in_memory`'s common case: one piece
            return self.memory
        content = self.in_memory()
        if content is not None:
            return content
        assert self._spool is not None
        if not self.held.size:
            await self._take_for_store()
            self.held.size = self.size
        self._spool.flush()
        return os.pread(self._spool.fileno(), self.size, 0)

    async def _take_for_store(self) -> None:
        """Room for the whole body, waited for a bounded time (`ResponseBudget.take`). The body is
        whole: the upstream answered. A shutdown's cancellation arriving during this wait ends
        the wait, not the store write: cut off here, an outcome that is known would be recorded
        unknown (SPEC §3.2) and its client answered 504."""
        try:
            await self._budget.take(self.size)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling() != 1:
                raise  # cancelled again, or not by the drain: let it end
            task.uncancel()
            self._budget.overdraw(self.size)

    def _join(self) -> None:
        # b"".join holds the pieces and the whole at once: the whole is taken from the budget
        # too, or, without room for it, the pieces go to disk.
        if not self.held.add(self.size):
            self._spill()
            return
        self._chunks = [b"".join(self._chunks)]
        self.memory = self._chunks[0]
        self._budget.give_back(self.size)
        self.held.size -= self.size

    async def pieces(self) -> AsyncIterator[bytes]:
        """The captured bytes in order, a piece at a time (for the client)."""
        if self._spool is None:
            for chunk in self._chunks:
                yield chunk
            return
        self._spool.flush()
        fd, offset = self._spool.fileno(), 0
        while offset < self.size:
            piece = os.pread(fd, min(_PIECE, self.size - offset), offset)
            if not piece:
                return
            offset += len(piece)
            yield piece

    def release(self) -> None:
        """Nothing of it stays in memory: the budget gets its bytes back."""
        self.held.release()
        if self._spool is not None:
            self._chunks = []

    def close(self) -> None:
        self.release()
        self._chunks, self.memory = [], None
        if self._spool is not None:
            self._spool.close()


async def capture(upstream: BodySource, limit: int, budget: ResponseBudget) -> Captured:
    """Up to `limit` bytes of the body (and one piece more when it is larger)."""
    captured = Captured(budget)
    try:
        while captured.size <= limit:
            chunk, last = await upstream.read_piece()
            if chunk:
                captured.add(chunk)
            if last:
                captured.whole = captured.size <= limit
                break
    except BaseException:
        captured.close()
        raise
    return captured


async def tee(
    upstream: BodySource, client: ClientSink, limit: int, budget: ResponseBudget
) -> Captured:
    """The body to `client` as it arrives, and kept up to `limit` bytes (`whole` when it all
    was): a stream (SPEC §2 step 4) is stored once it has ended, not before its client sees it."""
    kept, over = Captured(budget), False
    try:
        while chunk := await upstream.read_chunk():
            await client.write(chunk)
            if over:
                continue
            if kept.size + len(chunk) > limit:
                kept.close()  # too large to keep (SPEC §7): nothing of it stays held
                kept, over = Captured(budget), True
                continue
            kept.add(chunk)
    except BaseException:
        kept.close()
        raise
    kept.whole = not over
    return kept


def answer(
    captured: Captured, status: int, reason: str, headers: CIMultiDict[str]
) -> web.StreamResponse:
    """The first client's response to a whole captured body (stored, or settled, by now)."""
    content = captured.memory
    if content is None:  # in pieces (joined now, if the budget has room) or on disk
        content = captured.in_memory()
    if content is None:
        captured.release()  # its store write, if any, is done: the client is answered from disk
        return SpooledResponse(captured, status=status, reason=reason, headers=headers)
    if len(content) <= ONE_WRITE_BODY:
        # One write when its handler returns (proxy/server/connection.py): given back then.
        captured.release()
        return AsSentResponse(status=status, reason=reason, body=content, headers=headers)
    # Given back once written (proxy/server/connection.py), not when the handler returns.
    return NotifiedResponse(
        status=status,
        reason=reason,
        body=content,
        headers=headers,
        done=captured.close,
        hold=captured.budget_hold,
    )


def on_disk(budget: ResponseBudget, body: bytes) -> Captured:
    """`body` in a temporary file, for an answer that the budget has no room for."""
    captured = Captured(budget)
    captured.size, captured.whole = len(body), True
    captured._chunks = [body]
    captured._spill()
    return captured


class SpooledResponse(AsSentStreamResponse):
    """A stored body answered from its temporary file, a piece at a time."""

    def __init__(
        self,
        captured: Captured,
        *,
        status: int,
        headers: CIMultiDict[str],
        reason: str | None = None,
    ) -> None:
        super().__init__(status=status, reason=reason, headers=headers)
        self.content_length = captured.size
        self._captured = captured
        self.pieces_sent = False

    def close(self) -> None:
        """Never to be sent: its file is closed now, not at some later garbage collection."""
        self._captured.close()

    async def prepare(self, request: web.BaseRequest) -> Any:
        try:
            return await super().prepare(request)
        except BaseException:
            self._captured.close()  # the client is gone: write_eof will not run
            raise

    async def write_eof(self, data: bytes = b"") -> None:
        try:
            if not self.pieces_sent:
                self.pieces_sent = True
                async for piece in self._captured.pieces():
                    await self.write(piece)
            await super().write_eof(data)
        finally:
            self._captured.close()


def drop_unsent(response: web.StreamResponse | None) -> None:
    """A response that will never be sent (its client left, or another answer was chosen)
    gives back what it holds now: a spooled one its file descriptor, a notified one its
    budget's bytes. Without this they wait for a full garbage collection, which the server's
    gc.freeze and raised thresholds make rare."""
    if isinstance(response, SpooledResponse):
        response.close()
    elif isinstance(response, NotifiedResponse):
        response.written()
