"""Leases kept alive while an attempt runs (SPEC §3.5), against the real SQLite store."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from idemproxy.core.types import Claimed, Intent
from idemproxy.errors import StoreUnavailable
from idemproxy.proxy.jobs.jobrun import KeptLease
from idemproxy.store.sqlite.store import SqliteStore


async def claimed_job(store: SqliteStore, lease: float) -> Claimed:
    intent = Intent(owner="o", key="k", fingerprint="f", method="POST", path="/pay")
    claim = await store.claim(intent, str(uuid.uuid4()), "http://up", ttl=60, lease=lease)
    assert isinstance(claim, Claimed)
    return claim


async def test_a_long_attempt_keeps_its_lease_and_a_short_one_never_renews(
    tmp_path: Path,
) -> None:
    store = SqliteStore(str(tmp_path / "jobs.db"))
    await store.open()
    await store.migrate()
    renewals: list[float] = []
    renew = store.renew_lease

    async def counted(*args: object, **kwargs: object) -> bool:
        renewals.append(asyncio.get_running_loop().time())
        return await renew(*args, **kwargs)  # type: ignore[arg-type]

    store.renew_lease = counted  # type: ignore[method-assign]
    try:
        job = (await claimed_job(store, lease=0.6)).job
        async with KeptLease(store, job, lease=0.6):
            await asyncio.sleep(0.05)
        assert renewals == []  # ended before the first renewal was due: no task, no call

        async with KeptLease(store, job, lease=0.6):
            await asyncio.sleep(1.3)  # twice the lease: alive only if it was renewed
            current = await store.get("o", "k")
            assert current is not None and not current.lease_expired
        assert len(renewals) >= 3  # every 0.2 s from 0.2 s on
        await asyncio.sleep(0.5)
        count = len(renewals)
        await asyncio.sleep(0.5)
        assert len(renewals) == count  # stopped with the block
    finally:
        await store.close()


async def test_a_failed_renewal_is_retried_within_what_is_left_of_the_lease(
    tmp_path: Path,
) -> None:
    """SPEC §3.5: the first renewal (due at 0.2 s of a 0.6 s lease) fails after 0.2 s, as one
    does that waits out pool.store_timeout behind a row lock; the next try follows at once, not
    a third of the lease later (0.6 s, as the lease ends). That one hangs, and is bounded by the
    time the lease has left: a third try follows it."""
    store = SqliteStore(str(tmp_path / "jobs.db"))
    await store.open()
    await store.migrate()
    loop = asyncio.get_running_loop()
    tries: list[float] = []
    renew = store.renew_lease
    failures = [0.2, 10.0]  # seconds the first two tries take before failing (or hanging)

    async def slow_then_fine(*args: object, **kwargs: object) -> bool:
        tries.append(loop.time())
        if failures:
            await asyncio.sleep(failures.pop(0))
            raise StoreUnavailable()
        return await renew(*args, **kwargs)  # type: ignore[arg-type]

    store.renew_lease = slow_then_fine  # type: ignore[method-assign]
    try:
        job = (await claimed_job(store, lease=0.6)).job
        started = loop.time()
        async with KeptLease(store, job, lease=0.6):
            await asyncio.sleep(0.9)
            current = await store.get("o", "k")
            assert current is not None and not current.lease_expired
        first, second, third = (moment - started for moment in tries[:3])
        assert 0.15 < first < 0.3
        assert second - first < 0.2 + 0.15  # retried at once after the slow failure
        assert third < 0.6 + 0.15  # the hanging try ended with the lease, and one more followed
    finally:
        await store.close()
