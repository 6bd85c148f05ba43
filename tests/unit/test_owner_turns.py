"""SPEC §9: an owner's quota claims take turns in the process (store/postgres/quota.py), before
taking a pooled connection; other owners never wait on them."""

from __future__ import annotations

import asyncio

import pytest

from idemproxy.errors import StoreUnavailable
from idemproxy.store.postgres.quota import OwnerTurns


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
