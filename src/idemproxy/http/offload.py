"""Work on a body that can take long, moved off the event loop.

Parsing a JSON body (the key of a JSON Pointer source, SPEC §4.1; the fingerprint's canonical
form, SPEC §6; a response checked against a contract, SPEC §3.4) costs about 60 µs per KiB: a
9 MiB body held the event loop, and every other request of the process, for 1.5 s. A body
above `OFF_LOOP_BYTES` is parsed on a worker thread instead; a smaller one stays on the loop,
where it costs less than the hand-off (about 50 µs) would save until a few KiB, and at most
about 1 ms at the threshold. A small body with many containers may be nested too deep for the
C parser, whose pure-Python fallback (identity/deep_json.py) is 10 to 20 times slower: it goes
to the thread too.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

OFF_LOOP_BYTES = 16 * 1024
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
