"""SPEC §9: an owner's quota claims take turns in the process (store/postgres/quota.py), before
taking a pooled connection; other owners never wait on them."""

from __future__ import annotations

import asyncio

import pytest

from idemproxy.errors import StoreUnavailable
from idemproxy.store.postgres.quota import OneAtATime, OwnerTurns


async def test_one_claim_per_owner_at_a_time_and_other_owners_go_on() -> None:
    turns = OwnerTurns(timeout=5.0)
    order: list[str] = []
    release = asyncio.Event()

    async def claim(owner: str, name: str) -> None:
        async with turns.turn(owner):
            order.append(name)
            if name == "a1":
                await release.wait()

    first = asyncio.create_task(claim("a", "a1"))
    second = asyncio.create_task(claim("a", "a2"))
    await asyncio.sleep(0.01)
    await claim("b", "b1")  # not behind owner a's turn
    assert order == ["a1", "b1"]
    assert turns.busy("a") and not turns.busy("b")
    release.set()
    await asyncio.gather(first, second)
    assert order == ["a1", "b1", "a2"]
    assert not turns  # no owner's entry is left once its claims are done


async def test_a_turn_waited_for_too_long_is_the_store_unavailable() -> None:
    turns = OwnerTurns(timeout=0.05)
    async with turns.turn("a"):
        with pytest.raises(StoreUnavailable):
            async with turns.turn("a"):
                pass
    async with turns.turn("a"):  # the one that gave up left the turns as they were
        pass
    assert not turns


async def test_an_owners_usage_is_read_by_one_claim_at_a_time() -> None:
    """While an owner's turn is taken, its claims read its usage without the lock to refuse
    a flood at once; each read holds a pooled connection, so one owner reads one at a time
    and every other owner's reads go on (a read each took the whole pool)."""
    reads = OneAtATime()
    active: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}

    async def read(owner: str) -> None:
        async with reads.slot(owner):
            active[owner] += 1
            most[owner] = max(most[owner], active[owner])
            await asyncio.sleep(0.005)
            active[owner] -= 1

    await asyncio.gather(*(read("a") for _ in range(20)), *(read("b") for _ in range(3)))
    assert most == {"a": 1, "b": 1}
    assert reads._slots == {}  # no entry outlives its last user


async def test_a_slot_is_given_up_when_its_holder_is_cancelled() -> None:
    reads = OneAtATime()
    entered = asyncio.Event()

    async def hold() -> None:
        async with reads.slot("a"):
            entered.set()
            await asyncio.sleep(10)

    holder = asyncio.create_task(hold())
    await entered.wait()
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder
    async with asyncio.timeout(1.0), reads.slot("a"):
        pass
    assert reads._slots == {}
