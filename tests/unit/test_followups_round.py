"""One follow-up per job (proxy/background/followups.py): an item replaced while a round is
under way is not written by that round, and every item is counted once.

The kind here is a stand-in whose write of job `j1` waits until the test lets it go, as a
store that is slow for one statement does: what is under test is the loop, not a store."""

from __future__ import annotations

import asyncio

from idemproxy.store.ports import JobStore
from tests.support.followups import CountedFollowUps, Done


class HeldFollowUps(CountedFollowUps[tuple[str, str]]):
    """Items are (job id, label); the write of `j1` waits for `released`."""

    def __init__(self) -> None:
        super().__init__()
        self.released = asyncio.Event()
        self.written: list[str] = []

    def hold(self, job_id: str, label: str) -> None:
        self._add(job_id, (job_id, label))

    async def _settle(self, store: JobStore, item: tuple[str, str]) -> Done | None:
        if item[0] == "j1":
            await self.released.wait()
        self.written.append(item[1])
        return Done.WRITTEN


async def test_an_item_replaced_during_a_round_is_not_written_by_it_and_counted_once() -> None:
    follow_ups = HeldFollowUps()
    follow_ups.hold("j1", "first")
    follow_ups.hold("j2", "older")
    await asyncio.sleep(0.15)  # the round began: its write of j1 waits
    assert follow_ups.written == []
    follow_ups.hold("j2", "newer")  # takes the older one's place, which the round had listed
    follow_ups.released.set()
    for _ in range(100):  # the loop's own rounds, not the shutdown's
        if not len(follow_ups):
            break
        await asyncio.sleep(0.02)
    await follow_ups.close()
    assert sorted(follow_ups.written) == ["first", "newer"]  # "older" never written
    assert follow_ups.counts() == {"written": 2, "moved_on": 1}  # three items, three counts
