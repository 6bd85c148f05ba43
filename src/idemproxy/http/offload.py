"""Work on a body that can take long, moved off the event loop.

Parsing a JSON body (the key of a JSON Pointer source, SPEC §4.1; the fingerprint's canonical
form, SPEC §6; a response checked against a contract, SPEC §3.4) costs about 60 µs per KiB: a
9 MiB body held the event loop, and every other request of the process, for 1.5 s. A body
above `OFF_LOOP_BYTES` is parsed on a worker thread instead; a smaller one stays on the loop,
where it costs less than the hand-off (about 50 µs) would save until a few KiB, and at most
about 1 ms at the threshold. A small body with many containers may be nested too deep for the
C parser, whose pure-Python fallback (identity/deep_json.py) is 10 to 20 times slower: it goes
to the thread too.

A thread is not enough for a large body: the C parser reads a flat object or array in one call
that never lets another thread have the interpreter (a 9 MiB object of 700,000 members held the
loop for about 1.2 s from a worker thread). A body above `IN_PROCESS_BYTES` is parsed in a worker
process instead (`Offload`): a small pool, started with the first such body, each process with
its own interpreter; the body goes to it and the small result (a key, a fingerprint) comes back.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import resource_tracker
from typing import ParamSpec, TypeVar

from idemproxy.errors import ProblemError

log = logging.getLogger(__name__)

OFF_LOOP_BYTES = 16 * 1024
# Above this, a body's work goes to a worker process (when there are any, `Offload`): parsed on
# a thread, a flat 64 KiB body may hold the interpreter for about 4 ms in one C call.
IN_PROCESS_BYTES = 64 * 1024
# Fewer containers than the C parser's recursion limit (about 1,000, less the loop's own frames)
# cannot nest too deep for it.
OFF_LOOP_CONTAINERS = 256

P = ParamSpec("P")
T = TypeVar("T")


def heavy(body: bytes) -> bool:
    """Whether parsing `body` as JSON may hold the loop for more than about 1 ms."""
    if len(body) > OFF_LOOP_BYTES:
        return True
    return body.count(b"[") + body.count(b"{") > OFF_LOOP_CONTAINERS


async def off_loop(body: bytes, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`work(*args, **kwargs)`, on a worker thread when `body` is `heavy`, else in place."""
    if heavy(body):
        return await in_thread(work, *args, **kwargs)
    return work(*args, **kwargs)


async def in_thread(work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`work(*args, **kwargs)` on a worker thread, with the cyclic garbage collector paused."""
    return await asyncio.to_thread(_collector_paused, functools.partial(work, *args, **kwargs))


class _Pauses:
    """The cyclic garbage collector, paused while any thread parses a large body, and the
    interpreter's switch interval shortened.

    A 9 MiB body is half a million containers: their allocation sets off full collections,
    each of which walks every object of the process (150 to 330 ms, measured) holding the
    interpreter, so the event loop stood still as if the body were parsed on it. A parsed
    document holds no reference cycle (JSON is a tree): it is freed by reference counting alone,
    and the collections resume after the last parse. Never re-enabled if it was off before.
    The event loop waits for the worker to hand over the interpreter after each of its wake-ups
    (up to `sys.getswitchinterval()`, 5 ms by default, several times per request): 1 ms meanwhile
    took the median pass-through during 9 MiB uploads from 21 ms to 9 ms (2.3 ms idle).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._resume = False
        self._interval = sys.getswitchinterval()

    def enter(self) -> None:
        with self._lock:
            if self._count == 0:
                self._resume = gc.isenabled()
                gc.disable()
                self._interval = sys.getswitchinterval()
                sys.setswitchinterval(min(self._interval, _SWITCH_SECONDS))
            self._count += 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0:
                sys.setswitchinterval(self._interval)
                if self._resume:
                    gc.enable()


# While a worker parses, the event loop waits for the interpreter after each of its wake-ups
# for at most this long, rather than the default 5 ms: a pass-through request has a few.
_SWITCH_SECONDS = 0.001
_PAUSES = _Pauses()


def _collector_paused(work: Callable[[], T]) -> T:
    _PAUSES.enter()
    try:
        return work()
    finally:
        _PAUSES.leave()


class Offload:
    """Where a body's work runs: in place, on a worker thread (`off_loop`), or, for a body above
    `IN_PROCESS_BYTES`, in one of at most `processes` worker processes (0: on a thread).

    The processes are started (`spawn`: nothing of this process's state is copied, no thread of
    it forked) with the first such body, and stopped by `close`. They run at a lower scheduling
    priority than the serving process: on a busy host the event loop gets the CPU first. `work`
    and its arguments go to the process by pickling: a function of a module, or a method of an
    object that pickles, and what it raises must pickle too (an `IdemproxyError` does).
    """

    def __init__(self, processes: int) -> None:
        self._processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False

    async def __call__(
        self, body: bytes, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`work(*args, **kwargs)` where `body`, the body it reads, is best worked on.
        `ProblemError` (500) if the process working on it dies meanwhile."""
        if self._processes == 0 or self._closed or len(body) <= IN_PROCESS_BYTES:
            return await off_loop(body, work, *args, **kwargs)
        return await self._in_process(functools.partial(work, *args, **kwargs))

    async def coded(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`work(*args, **kwargs)` on a body sent with a content coding, whatever its size: its
        decoded size is known only once decoded (9 KiB of gzip can be 9 MiB of JSON), so it is
        never worked on in place: in a worker process, or on a thread without them."""
        if self._processes == 0 or self._closed:
            return await in_thread(work, *args, **kwargs)
        return await self._in_process(functools.partial(work, *args, **kwargs))

    async def _in_process(self, call: Callable[[], T]) -> T:
        pool = self._started()
        try:
            return await asyncio.wrap_future(pool.submit(_collector_paused, call))
        except BrokenProcessPool as exc:
            # Killed under the body, most likely by the OOM killer, which picks the largest
            # process: parsed here instead, that body would take the proxy process with it.
            # The next body gets a new pool.
            log.warning("a body parsing process died (out of memory?): %s", exc)
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False)
            raise ProblemError(_DIED) from exc

    async def close(self) -> None:
        """Stop the processes, after the work they were given; a body after this is worked on
        on a thread."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)

    def _started(self) -> ProcessPoolExecutor:
        if self._pool is None:
            _start_resource_tracker()
            self._pool = ProcessPoolExecutor(
                self._processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_started,
            )
        return self._pool


def _start_resource_tracker() -> None:
    """multiprocessing's resource tracker, started (as the pool would) with SIGHUP ignored,
    which it inherits: it ignores only SIGINT and SIGTERM itself, and a terminal's hang-up to
    the process group killed it while the serving process drained (SPEC §8), with a traceback
    for every shared object it no longer tracked. In the main thread only, as `signal` allows;
    elsewhere the pool starts it as before."""
    previous = signal.getsignal(signal.SIGHUP)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        return  # not this thread's to change, or a handler no Python code could put back
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)


_DIED = "The process parsing the request body ended before it was done (out of memory?)."
# Worker processes yield the CPU to the serving process (nice(2): 0 to 19, higher is lower).
_WORKER_NICENESS = 10


def _worker_started() -> None:
    """In each worker process: lower priority, Ctrl-C and a hang-up (SIGINT and SIGHUP to the
    terminal's process group) left to the serving process, which stops the workers as it shuts
    down, and an exit of its own if the serving process dies without doing so (SIGKILL, the OOM
    killer): a worker would otherwise wait for work forever, since it holds both ends of its
    queue's pipe."""
    os.nice(_WORKER_NICENESS)
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: multiprocessing.process.BaseProcess) -> None:
    parent.join()  # returns when the parent process has ended
    os._exit(1)
