"""http/offload.py: which bodies are parsed off the event loop, and the collector's pause."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

from idemproxy.http import offload


def test_a_body_is_heavy_by_its_size_or_its_containers() -> None:
    assert not offload.heavy(b'{"order_id": "a", "n": [1, 2, 3]}')
    assert not offload.heavy(b" " * offload.OFF_LOOP_BYTES)
    assert offload.heavy(b" " * (offload.OFF_LOOP_BYTES + 1))
    # Small, but possibly too deep for the C parser: its fallback is slower (deep_json.py).
    assert offload.heavy(b"[" * 300 + b"]" * 300)
    assert not offload.heavy(b"[" * 100 + b"]" * 100)


def _where() -> tuple[int, bool, float]:
    return threading.get_ident(), gc.isenabled(), sys.getswitchinterval()


async def test_a_light_body_stays_on_the_loop_and_a_heavy_one_goes_to_a_thread() -> None:
    loop_thread = threading.get_ident()
    interval = sys.getswitchinterval()
    assert await offload.off_loop(b"{}", _where) == (loop_thread, True, interval)
    thread, collecting, switch = await offload.off_loop(b"[" * 20_000, _where)
    assert thread != loop_thread
    assert not collecting  # paused while it parses
    assert switch <= 0.001  # the loop gets the interpreter back sooner meanwhile
    assert gc.isenabled()  # and both are as they were after
    assert sys.getswitchinterval() == interval


async def test_the_collector_resumes_after_the_last_of_concurrent_parses() -> None:
    inside = threading.Barrier(2)
    leave = threading.Event()

    def parse() -> bool:
        inside.wait(5)
        leave.wait(5)
        return gc.isenabled()

    first = asyncio.ensure_future(offload.in_thread(parse))
    second = asyncio.ensure_future(offload.in_thread(parse))
    await asyncio.sleep(0.05)
    assert not gc.isenabled()
    leave.set()
    assert [await first, await second] == [False, False]
    assert gc.isenabled()


async def test_a_collector_turned_off_stays_off() -> None:
    gc.disable()
    try:
        assert await offload.in_thread(gc.isenabled) is False
        assert not gc.isenabled()
    finally:
        gc.enable()
