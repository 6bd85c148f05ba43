"""A shutdown gives held follow-ups one more chance for at most its grace
(proxy/background/followups.py): not a round of tries each as long as the store allows.

The kind here is a stand-in whose every try takes 0.3 s and settles its item, as a store that
answers slowly does: what is under test is the loop's deadline, not a store."""

from __future__ import annotations

import asyncio
import time

from idemproxy.store.ports import JobStore
from tests.support.followups import CountedFollowUps, Done


class SlowFollowUps(CountedFollowUps[str]):
    """Each try takes `seconds` and then settles its item."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.tried: list[str] = []

    def hold(self, job_id: str) -> None:
        self._add(job_id, job_id)

    async def _settle(self, store: JobStore, item: str) -> Done | None:
        self.tried.append(item)
        await asyncio.sleep(self.seconds)
        return Done.WRITTEN


async def test_a_shutdown_tries_what_is_held_at_once() -> None:
    follow_ups = SlowFollowUps(0.01)
    for n in range(3):
        follow_ups.hold(f"job-{n}")
    await follow_ups.close(grace=5.0)
    assert len(follow_ups) == 0 and sorted(follow_ups.tried) == ["job-0", "job-1", "job-2"]


async def test_a_slow_store_does_not_stretch_the_grace() -> None:
    follow_ups = SlowFollowUps(0.3)
    for n in range(20):
        follow_ups.hold(f"job-{n}")
    started = time.monotonic()
    await follow_ups.close(grace=1.0)
    assert time.monotonic() - started < 1.3  # 20 tries of 0.3 s would take 6 s
    written, dropped = follow_ups.counted(Done.WRITTEN), follow_ups.counted(Done.DROPPED)
    assert 0 < written < 20 and written + dropped == 20  # the rest left to the lease, counted
    assert len(follow_ups) == 0


async def test_without_grace_nothing_more_is_tried() -> None:
    follow_ups = SlowFollowUps(0.01)
    follow_ups.hold("job-0")
    await follow_ups.close()
    assert follow_ups.tried == [] and follow_ups.counted(Done.DROPPED) == 1
