"""proxy/server/capture.py: the response budget's accounting, order and cancellation."""

from __future__ import annotations

import asyncio
import os

import pytest
from multidict import CIMultiDict

from idemproxy.proxy.server.capture import (
    Captured,
    Held,
    ResponseBudget,
    SpooledResponse,
    drop_unsent,
    on_disk,
)
from idemproxy.proxy.server.connection import NotifiedResponse


async def test_try_take_never_waits_and_never_exceeds_the_limit() -> None:
    budget = ResponseBudget(10)
    assert budget.try_take(6)
    assert not budget.try_take(5)
    assert budget.try_take(4)
    assert budget.used == 10
    budget.give_back(10)
    assert budget.used == 0


async def test_take_waits_for_room_first_come_first_served() -> None:
    budget = ResponseBudget(10)
    assert budget.try_take(8)
    order: list[str] = []

    async def take(name: str, size: int) -> None:
        await budget.take(size)
        order.append(name)

    first = asyncio.create_task(take("first", 5))
    await asyncio.sleep(0)
    second = asyncio.create_task(take("second", 1))
    await asyncio.sleep(0)
    # The second would fit now, but waits behind the first; nor may try_take jump the queue.
    assert order == [] and not budget.try_take(1)
    budget.give_back(8)
    await asyncio.gather(first, second)
    assert order == ["first", "second"] and budget.used == 6


async def test_a_body_larger_than_the_budget_goes_alone() -> None:
    budget = ResponseBudget(4)
    assert budget.try_take(1)
    waiting = asyncio.create_task(budget.take(9))
    await asyncio.sleep(0)
    assert not waiting.done()
    budget.give_back(1)
    await waiting
    assert budget.used == 9


async def test_a_waiter_cancelled_before_its_turn_takes_nothing_and_lets_the_next_in() -> None:
    budget = ResponseBudget(10)
    assert budget.try_take(10)
    big = asyncio.create_task(budget.take(10))
    small = asyncio.create_task(budget.take(2))
    await asyncio.sleep(0)
    big.cancel()
    budget.give_back(3)
    await small
    assert big.cancelled() and budget.used == 9


async def test_held_gives_back_exactly_once() -> None:
    budget = ResponseBudget(10)
    held = Held(budget)
    assert held.add(4) and held.add(3) and not held.add(4)
    held.release()
    held.release()
    assert budget.used == 0 and held.size == 0


async def test_take_waits_a_bounded_time_then_overdraws_and_counts_it() -> None:
    counted: list[None] = []
    budget = ResponseBudget(10, wait=0.05, overdrawn=lambda: counted.append(None))
    assert budget.try_take(10)  # held by a client that never reads
    async with asyncio.timeout(1):
        await budget.take(5)
    assert budget.used == 15 and budget.overdrafts == 1 and len(counted) == 1
    budget.give_back(15)
    assert budget.used == 0 and budget.try_take(10)  # the abandoned wait left no trace


async def test_an_overdraft_does_not_jump_ahead_of_a_waiter_that_fits_later() -> None:
    budget = ResponseBudget(10, wait=0.05)
    assert budget.try_take(10)
    first = asyncio.create_task(budget.take(4))
    await asyncio.sleep(0)
    second = asyncio.create_task(budget.take(4))
    async with asyncio.timeout(1):
        await asyncio.gather(first, second)
    assert budget.used == 18 and budget.overdrafts == 2
    budget.give_back(18)
    assert budget.used == 0


async def test_a_notified_response_gives_back_after_its_hold_at_the_latest() -> None:
    given: list[None] = []
    response = NotifiedResponse(body=b"x" * 100, done=lambda: given.append(None), hold=0.05)
    await asyncio.sleep(0.1)
    assert len(given) == 1  # its client never read it: the budget has its bytes back
    response.written()  # written at last: given back once only
    assert len(given) == 1


async def test_an_unsent_spooled_answer_closes_its_file_and_an_unsent_notified_one_gives_back() -> (
    None
):
    budget = ResponseBudget(0)
    captured = on_disk(budget, b"x" * 1000)
    spooled = SpooledResponse(captured, status=200, headers=CIMultiDict())
    fd = captured._spool.fileno() if captured._spool is not None else -1
    os.fstat(fd)
    drop_unsent(spooled)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed now, not at a later garbage collection
    given: list[None] = []
    notified = NotifiedResponse(body=b"x", done=lambda: given.append(None))
    drop_unsent(notified)
    drop_unsent(None)
    assert len(given) == 1


async def test_a_captured_body_s_memory_field_is_its_content_while_one_piece_in_memory() -> None:
    """`Captured.memory`, which the completion reads in place of `content`: the body while it is
    one bytes object in memory, None in pieces or on disk, never another body's bytes."""
    budget = ResponseBudget(1_000)
    one = Captured(budget)
    assert one.memory == b""
    one.add(b"abc")
    assert one.memory == b"abc" == await one.content()
    one.add(b"def")  # two pieces: `content` joins them
    assert one.memory is None
    assert await one.content() == b"abcdef" == one.memory
    one.close()
    assert one.memory is None and budget.used == 0

    tight = Captured(ResponseBudget(4))
    tight.add(b"abc")
    tight.add(b"defgh")  # no room: both pieces go to disk
    assert tight.spooled and tight.memory is None
    assert await tight.content() == b"abcdefgh"
    tight.close()
