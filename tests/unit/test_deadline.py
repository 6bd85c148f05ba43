"""http/deadline.py: one timer for a deadline that is started again and again."""

from __future__ import annotations

import asyncio

from idemproxy.http.deadline import Deadline


class _Expiries:
    def __init__(self) -> None:
        self.at: list[float] = []
        self.began = asyncio.get_running_loop().time()

    def __call__(self) -> None:
        self.at.append(asyncio.get_running_loop().time() - self.began)


async def test_it_expires_once_its_timeout_after_the_start() -> None:
    expiries = _Expiries()
    deadline = Deadline(asyncio.get_running_loop(), expiries)
    deadline.start(0.1)
    assert deadline.due is not None
    await asyncio.sleep(0.3)
    assert len(expiries.at) == 1 and 0.09 <= expiries.at[0] < 0.25
    assert deadline.due is None


async def test_a_later_start_moves_it_although_the_timer_was_set_for_the_first() -> None:
    expiries = _Expiries()
    deadline = Deadline(asyncio.get_running_loop(), expiries)
    deadline.start(0.1)
    await asyncio.sleep(0.06)
    deadline.start(0.1)  # now due at about 0.16 s
    await asyncio.sleep(0.3)
    assert len(expiries.at) == 1 and 0.15 <= expiries.at[0] < 0.3


async def test_stopped_or_closed_it_never_expires() -> None:
    expiries = _Expiries()
    loop = asyncio.get_running_loop()
    stopped, closed = Deadline(loop, expiries), Deadline(loop, expiries)
    stopped.start(0.05)
    stopped.due = None
    closed.start(0.05)
    closed.close()
    await asyncio.sleep(0.15)
    assert expiries.at == []
    assert stopped.due is None and closed.due is None


async def test_started_again_after_a_stop_it_expires_from_the_new_start() -> None:
    expiries = _Expiries()
    deadline = Deadline(asyncio.get_running_loop(), expiries)
    for _ in range(3):  # many short waits, each ended in time
        deadline.start(0.1)
        await asyncio.sleep(0.04)
        deadline.due = None
    deadline.start(0.1)  # the last one, from about 0.12 s
    await asyncio.sleep(0.35)
    assert len(expiries.at) == 1 and 0.21 <= expiries.at[0] < 0.4


async def test_a_shorter_timeout_after_a_longer_one_expires_on_time() -> None:
    """A pooled upstream connection serves routes with different `upstream_timeout`s: the
    timer set for a long wait must not hold back a shorter one started after it."""
    expiries = _Expiries()
    deadline = Deadline(asyncio.get_running_loop(), expiries)
    deadline.start(10.0)
    deadline.due = None
    deadline.start(0.1)
    await asyncio.sleep(0.4)
    assert len(expiries.at) == 1 and 0.09 <= expiries.at[0] < 0.35


async def test_a_due_set_as_a_field_where_the_timer_fires_before_it_is_kept_to() -> None:
    """The hot path's start (proxy/server/connection.py, proxy/upstream/client.py): `due` set
    directly when `armed <= due` expires at that `due`, neither earlier nor never."""
    expiries = _Expiries()
    deadline = Deadline(asyncio.get_running_loop(), expiries)
    assert deadline.armed == float("inf")  # no timer: such a start must go through `start`
    deadline.start(0.05)
    deadline.due = None
    due = deadline.time() + 0.15
    assert deadline.armed <= due
    deadline.due = due  # the timer fires at about 0.05 s, finds 0.15, and is set again for it
    await asyncio.sleep(0.3)
    assert len(expiries.at) == 1 and 0.14 <= expiries.at[0] < 0.28
    assert deadline.armed == float("inf")  # fired, not set again: nothing runs
