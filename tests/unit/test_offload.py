"""http/offload.py: which bodies are parsed off the event loop, and the collector's pause."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
from pydantic import ValidationError

from idemproxy.config.settings import load_settings
from idemproxy.constants import MAX_PARSE_PROCESSES
from idemproxy.errors import KeyInvalid, ProblemError
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


# --- worker processes: a large body's work, away from this interpreter ----------------------

LARGE = b" " * (offload.IN_PROCESS_BYTES + 1)


async def test_a_large_body_is_worked_on_in_a_worker_process() -> None:
    work = offload.Offload(processes=2)
    try:
        assert await work(b"{}", os.getpid) == os.getpid()  # a small body: in place
        assert await work(LARGE[:-1], _where) != _where()  # up to the bound: on a thread
        pid = await work(LARGE, os.getpid)
        assert pid != os.getpid()
        assert pid in {child.pid for child in multiprocessing.active_children()}
    finally:
        await work.close()
    assert pid not in {child.pid for child in multiprocessing.active_children()}


async def test_without_worker_processes_a_large_body_goes_to_a_thread() -> None:
    work = offload.Offload(processes=0)
    thread, collecting, _ = await work(LARGE, _where)
    assert thread != threading.get_ident() and not collecting
    assert multiprocessing.active_children() == []


async def test_what_the_work_raises_arrives_as_it_was_raised() -> None:
    work = offload.Offload(processes=1)
    try:
        with pytest.raises(KeyInvalid) as raised:
            await work(LARGE, _refuse, "not a key")
    finally:
        await work.close()
    assert raised.value.detail == "not a key"
    assert (raised.value.status, raised.value.code) == (400, "key-invalid")


def _refuse(detail: str) -> None:
    raise KeyInvalid(detail)


async def test_a_worker_that_died_fails_its_body_and_is_replaced() -> None:
    """A worker killed under its work (the OOM killer picks the largest process): that body is
    refused rather than parsed here, where it could take the serving process with it; the next
    one goes to a new worker."""
    work = offload.Offload(processes=1)
    try:
        first = await work(LARGE, os.getpid)
        with pytest.raises(ProblemError, match="ended before it was done") as died:
            await work(LARGE, _dies_unless_in, os.getpid())
        second = await work(LARGE, os.getpid)
    finally:
        await work.close()
    assert died.value.status == 500
    assert len({first, second, os.getpid()}) == 3


async def test_a_body_after_close_goes_to_a_thread_and_starts_no_process() -> None:
    work = offload.Offload(processes=1)
    await work(LARGE, os.getpid)
    await work.close()
    thread, _, _ = await work(LARGE, _where)
    assert thread != threading.get_ident()
    assert multiprocessing.active_children() == []


def _dies_unless_in(pid: int) -> int:
    if os.getpid() != pid:
        os._exit(1)
    return pid


def test_parse_processes_default_to_two_and_are_bounded() -> None:
    assert load_settings(upstream="http://x:1").server.parse_processes == 2
    assert (
        load_settings(upstream="http://x:1", server={"parse_processes": 0}).server.parse_processes
        == 0
    )
    for wrong in (-1, MAX_PARSE_PROCESSES + 1):
        with pytest.raises(ValidationError, match="parse_processes"):
            load_settings(upstream="http://x:1", server={"parse_processes": wrong})


_TRACKER_PROBE = """
import asyncio, os, signal
from idemproxy.http import offload

async def main():
    signal.signal(signal.SIGHUP, lambda *_: None)  # the serving process handles a hang-up
    work = offload.Offload(processes=1)
    try:
        await work(LARGE, os.getpid)
    finally:
        await work.close()

LARGE = b"[" + b"1," * 40000 + b"1]"
asyncio.run(main())
children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
for child in children:
    command = open(f"/proc/{child}/cmdline", "rb").read()
    if b"resource_tracker" in command:
        status = open(f"/proc/{child}/status").read()
        ignored = int(status.split("SigIgn:")[1].split()[0], 16)
        print("tracker ignores SIGHUP" if ignored & (1 << (signal.SIGHUP - 1)) else "tracker dies")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_resource_tracker_outlives_a_hang_up_of_the_process_group() -> None:
    """A terminal's SIGHUP to the process group killed multiprocessing's tracker (it ignores
    only SIGINT and SIGTERM), with a traceback per shared object, while the proxy drained."""
    done = subprocess.run(
        [sys.executable, "-c", _TRACKER_PROBE],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tracker ignores SIGHUP", (done.stdout, done.stderr)
