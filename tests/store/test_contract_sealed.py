"""Encryption at rest on every store (SPEC §11): SQLite, PostgreSQL, and PostgreSQL behind the
in-process replay cache. What the rows hold is read with plain SQL, as a dump shows it, and
tampered with as someone with write access to the database could."""

from __future__ import annotations

import asyncio

import pytest

from idemproxy.core.types import JobState, SealedResponse, StoredResponse
from idemproxy.errors import ResponseUnreadable
from idemproxy.ops.reseal import report_lines, reseal_store
from idemproxy.ops.resolution import Resolution
from idemproxy.ops.service import resolve_job
from idemproxy.store.layers import StoreStack
from idemproxy.store.ports import JobStore
from idemproxy.store.seal.codec import ResponseCodec
from idemproxy.store.seal.store import SealingStore
from tests.support.keyring import NEW, OLD, OTHER, codec
from tests.support.rawrows import RawRows

from .test_contract import RESPONSE, TTL, claim, job_of
from .test_contract_attempts import claim as claim_leased
from .test_contract_attempts import current

SECRET = b"card 4242 4242 4242 4242"
PRIVATE = StoredResponse(201, (("X-Customer", "Ada Lovelace"),), b'{"pan": "' + SECRET + b'"}')


@pytest.fixture
def rows(store_dsn: str) -> RawRows:
    return RawRows(store_dsn)


def sealing(stack: StoreStack, ring: ResponseCodec) -> SealingStore:
    """The hot path of a process with key ring `ring`, whose store of record seals and opens
    with it too (store/factory.py `wrap_with_seal`)."""
    stack.record.seal = ring
    return SealingStore(stack.top, ring)


async def sealed_job(store: JobStore, key: str = "k1", owner: str = "alice") -> str:
    claimed = await claim(store, key, owner)
    assert await store.complete(claimed.job, 1, PRIVATE, ttl=TTL)
    return claimed.job.id


def in_the_clear(row: dict[str, object]) -> bytes:
    """Every column of `row` as bytes, to look for a secret in any of them."""
    return b"".join(v if isinstance(v, bytes) else str(v).encode() for v in row.values())


async def test_a_response_is_kept_only_as_a_box_and_opens_as_it_was(
    stack: StoreStack, rows: RawRows
) -> None:
    sealed = sealing(stack, codec(OLD))
    job_id = await sealed_job(sealed)

    row = await rows.job(job_id)
    assert row["response_key"] == "k1" and row["response_headers"] is None
    assert SECRET not in bytes(row["response_body"]) and b"Lovelace" not in in_the_clear(row)
    for read in (await sealed.get("alice", "k1"), await job_of(stack.record, job_id)):
        assert read is not None and isinstance(read.response, SealedResponse)
        assert sealed.opened(read, read.response) == PRIVATE


async def test_a_flipped_byte_is_refused(stack: StoreStack, rows: RawRows) -> None:
    sealed = sealing(stack, codec(OLD))
    job_id = await sealed_job(sealed)
    box = bytearray((await rows.job(job_id))["response_body"])
    box[len(box) // 2] ^= 0x01
    await rows.set_job(job_id, "response_body", bytes(box))

    job = await job_of(stack.record, job_id)
    assert job.response is not None
    with pytest.raises(ResponseUnreadable, match="altered"):
        sealed.opened(job, job.response)


@pytest.mark.parametrize("other_owner", ["alice", "mallory"])
async def test_a_box_moved_to_another_job_is_refused(
    stack: StoreStack, rows: RawRows, other_owner: str
) -> None:
    sealed = sealing(stack, codec(OLD))
    victim = await sealed_job(sealed, "k1", "alice")
    thief = await claim(sealed, "k2", other_owner)
    assert await sealed.complete(thief.job, 1, StoredResponse(201, (), b"mine"), ttl=TTL)
    await rows.set_job(thief.job.id, "response_body", (await rows.job(victim))["response_body"])

    job = await job_of(stack.record, thief.job.id)
    assert job.response is not None
    with pytest.raises(ResponseUnreadable):
        sealed.opened(job, job.response)


async def test_a_status_changed_beside_its_box_is_refused(stack: StoreStack, rows: RawRows) -> None:
    sealed = sealing(stack, codec(OLD))
    job_id = await sealed_job(sealed)
    await rows.set_job(job_id, "response_status", 200)
    job = await job_of(stack.record, job_id)
    assert job.response is not None
    with pytest.raises(ResponseUnreadable):
        sealed.opened(job, job.response)


async def test_a_key_missing_from_the_ring_is_refused_by_its_id(stack: StoreStack) -> None:
    job_id = await sealed_job(sealing(stack, codec(OLD)))
    job = await job_of(stack.record, job_id)
    assert job.response is not None
    with pytest.raises(ResponseUnreadable, match="'k1', which is not in"):  # another ring
        sealing(stack, codec(OTHER)).opened(job, job.response)
    stack.record.seal = None  # no ring at all
    for reader in (stack.jobs, stack.record):
        with pytest.raises(ResponseUnreadable, match="'k1', which is not in"):
            reader.opened(job, job.response)


async def test_a_new_primary_seals_new_rows_and_old_ones_stay_readable(
    stack: StoreStack, rows: RawRows
) -> None:
    before = await sealed_job(sealing(stack, codec(OLD)), "k1")
    rotated = sealing(stack, codec(NEW, OLD))
    after = await sealed_job(rotated, "k2")
    assert [(await rows.job(i))["response_key"] for i in (before, after)] == ["k1", "k2"]
    for job_id in (before, after):
        job = await job_of(stack.record, job_id)
        assert job.response is not None and rotated.opened(job, job.response) == PRIVATE


async def test_reseal_seals_clear_and_old_rows_in_batches_once(
    stack: StoreStack, rows: RawRows
) -> None:
    clear = [await sealed_job(stack.jobs, f"clear-{n}") for n in range(2)]  # before encryption
    old = [await sealed_job(sealing(stack, codec(OLD)), f"old-{n}") for n in range(3)]
    ring = codec(NEW, OLD)

    report = await reseal_store(stack.record, ring, batch_size=2)

    assert (report.responses.resealed, report.responses.changed) == (5, 0)
    assert report.responses.unreadable == []
    retired = sealing(stack, codec(NEW))  # the old key can go now
    for job_id in clear + old:
        row = await rows.job(job_id)
        assert (row["response_key"], row["response_headers"]) == ("k2", None)
        job = await job_of(stack.record, job_id)
        assert job.response is not None and retired.opened(job, job.response) == PRIVATE
    again = await reseal_store(stack.record, ring, batch_size=2)
    assert (again.responses.resealed, again.late.resealed) == (0, 0)


async def test_reseal_lists_rows_whose_key_is_gone_and_leaves_them(stack: StoreStack) -> None:
    lost = await sealed_job(sealing(stack, codec(OTHER)), "lost")
    fine = await sealed_job(sealing(stack, codec(OLD)), "fine")
    ring = codec(NEW, OLD)
    report = await reseal_store(stack.record, ring, batch_size=10)
    assert (report.responses.resealed, report.responses.unreadable) == (1, [lost])
    kept = (await job_of(stack.record, lost)).response
    assert isinstance(kept, SealedResponse) and kept.key_id == "k9"
    moved = (await job_of(stack.record, fine)).response
    assert isinstance(moved, SealedResponse) and moved.key_id == "k2"


async def test_a_reseal_loses_to_a_deletion_and_to_another_reseal(stack: StoreStack) -> None:
    ring = codec(NEW, OLD)
    job = await job_of(stack.record, await sealed_job(sealing(stack, codec(OLD))))
    assert job.response is not None
    box = ring.reseal(job, job.response)
    assert box is not None
    assert await stack.record.reseal(job, box)
    assert not await stack.record.reseal(job, box)  # read under k1, k2 now: another won
    gone = await job_of(stack.record, await sealed_job(sealing(stack, codec(OLD)), "k2"))
    assert gone.response is not None
    assert await stack.record.delete(gone)
    stale = ring.reseal(gone, gone.response)
    assert stale is not None and not await stack.record.reseal(gone, stale)


async def test_a_late_response_is_sealed_and_resealed(stack: StoreStack, rows: RawRows) -> None:
    sealed = sealing(stack, codec(OLD))
    claimed = await claim_leased(sealed, lease=0.05)
    await asyncio.sleep(0.2)
    assert await sealed.take_over(await current(sealed, claimed.job))
    assert not await sealed.complete(claimed.job, 1, PRIVATE, ttl=TTL)

    late_row = await rows.late(claimed.job.id, 1)
    assert (late_row["late_key"], late_row["late_headers"]) == ("k1", None)
    assert SECRET not in bytes(late_row["late_body"])
    unknown = await job_of(stack.record, claimed.job.id)
    kept = await stack.record.late_response(unknown, 1)
    assert kept is not None and sealed.opened(unknown, kept) == PRIVATE

    ring = codec(NEW, OLD)
    report = await reseal_store(stack.record, ring, batch_size=1)
    assert (report.late.resealed, report.late.unreadable) == (1, [])
    assert (await rows.late(claimed.job.id, 1))["late_key"] == "k2"
    retired = sealing(stack, codec(NEW))
    kept = await stack.record.late_response(unknown, 1)
    assert kept is not None and retired.opened(unknown, kept) == PRIVATE
    # An operator resolves the job with it: the job's response is sealed too.
    assert await stack.record.resolve(unknown, JobState.COMPLETED, response=kept, ttl=TTL)
    resolved = await job_of(stack.record, unknown.id)
    assert resolved.response is not None and retired.opened(resolved, resolved.response) == PRIVATE
    assert (await rows.job(unknown.id))["response_key"] == "k2"


async def test_without_a_ring_responses_stay_in_the_clear(stack: StoreStack, rows: RawRows) -> None:
    claimed = await claim(stack.jobs)
    assert await stack.jobs.complete(claimed.job, 1, RESPONSE, ttl=TTL)
    row = await rows.job(claimed.job.id)
    assert row["response_key"] is None and bytes(row["response_body"]) == RESPONSE.body


async def test_a_box_whose_key_id_was_cleared_is_refused(stack: StoreStack, rows: RawRows) -> None:
    sealed = sealing(stack, codec(OLD))
    job_id = await sealed_job(sealed)
    await rows.set_job(job_id, "response_key", None)  # the box stays, its headers are NULL

    job = await job_of(stack.record, job_id)
    assert job.response is not None
    with pytest.raises(ResponseUnreadable, match="neither headers in the clear nor a key id"):
        sealed.opened(job, job.response)
    stack.record.seal = None
    with pytest.raises(ResponseUnreadable):  # nor served by a store with no ring at all
        stack.record.opened(job, job.response)


async def test_require_sealed_refuses_a_response_planted_in_the_clear(
    stack: StoreStack, rows: RawRows
) -> None:
    job_id = await sealed_job(sealing(stack, codec(OLD)))
    await rows.set_job(job_id, "response_key", None)
    await rows.set_job(job_id, "response_headers", '[["X-Planted","1"]]')
    await rows.set_job(job_id, "response_body", b"planted")

    lenient = sealing(stack, codec(OLD))
    job = await job_of(stack.record, job_id)
    assert job.response == StoredResponse(201, (("X-Planted", "1"),), b"planted")
    assert lenient.opened(job, job.response) == job.response  # the default: a clear row serves
    strict = sealing(stack, codec(OLD, require_sealed=True))
    with pytest.raises(ResponseUnreadable, match="require_sealed"):
        strict.opened(job, job.response)


async def test_under_require_sealed_a_reseal_leaves_rows_in_the_clear_and_lists_them(
    stack: StoreStack,
) -> None:
    """SPEC §11: with require_sealed on, no proxy writes a response in the clear: one found is
    planted (or left from before the switch-over). Sealing it would make it replayable, so the
    reseal leaves it, as it leaves a box that does not open, and names it (the CLI exits 1)."""
    claimed = await claim(stack.jobs, "clear", "alice")
    assert await stack.jobs.complete(claimed.job, 1, PRIVATE, ttl=TTL)
    strict = codec(OLD, require_sealed=True)
    report = await reseal_store(stack.record, strict, batch_size=10)
    assert (report.responses.resealed, report.responses.in_the_clear) == (0, [claimed.job.id])
    assert report.responses.left
    assert any(claimed.job.id in line and "in the clear" in line for line in report_lines(report))
    job = await job_of(stack.record, claimed.job.id)
    assert job.response is not None
    with pytest.raises(ResponseUnreadable):
        strict.open(job, job.response)  # still in the clear: still refused
    # Without require_sealed (the switch-over's own rows, sealed before turning it on).
    assert (await reseal_store(stack.record, codec(OLD), batch_size=10)).responses.resealed == 1


async def test_reseal_tells_a_box_that_does_not_open_from_a_key_not_in_the_ring(
    stack: StoreStack, rows: RawRows
) -> None:
    lost = await sealed_job(sealing(stack, codec(OTHER)), "lost")
    altered = await sealed_job(sealing(stack, codec(OLD)), "altered")
    await rows.set_job(altered, "response_status", 200)
    ring = codec(NEW, OLD)
    report = await reseal_store(stack.record, ring, batch_size=10)
    assert (report.responses.unreadable, report.responses.unopenable) == ([lost], [altered])
    lines = report_lines(report)
    assert f"1 unreadable (sealed with a key not in the ring), left as they are: {lost}" in lines
    assert f"1 unreadable (do not open: altered or moved), left as they are: {altered}" in lines


async def test_require_sealed_refuses_resolving_with_a_late_response_in_the_clear(
    stack: StoreStack, rows: RawRows
) -> None:
    """An operator's resolution from a late response kept in the clear would seal it as the
    job's response, to be replayed: under require_sealed it is refused as its replay would be."""
    claimed = await claim_leased(stack.jobs, lease=0.05)  # a proxy without the key ring
    await asyncio.sleep(0.2)
    assert await stack.jobs.take_over(await current(stack.jobs, claimed.job))
    assert not await stack.jobs.complete(claimed.job, 1, PRIVATE, ttl=TTL)  # kept on the attempt
    assert (await rows.late(claimed.job.id, 1))["late_key"] is None

    sealing(stack, codec(OLD, require_sealed=True))
    resolution = Resolution(JobState.COMPLETED, from_attempt=1)
    with pytest.raises(ResponseUnreadable, match="require_sealed"):
        await resolve_job(stack.record, claimed.job.id, resolution, default_ttl=TTL)
    assert (await job_of(stack.record, claimed.job.id)).state is JobState.UNKNOWN  # nothing changed
    lenient = sealing(stack, codec(OLD))
    await resolve_job(stack.record, claimed.job.id, resolution, default_ttl=TTL)
    resolved = await job_of(stack.record, claimed.job.id)
    assert resolved.response is not None and lenient.opened(resolved, resolved.response) == PRIVATE
