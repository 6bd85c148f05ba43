"""Encryption at rest with the Redis replay cache (SPEC §11): Redis holds only sealed bytes,
read here straight from Redis, and a hit is opened only after its fingerprint matched."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from idemproxy.constants import REDIS_JOB_PREFIX
from idemproxy.ops.reseal import reseal_store
from idemproxy.store.seal.store import SealingStore
from tests.support.backend import Ledger
from tests.support.keyring import NEW, OLD, OTHER, codec
from tests.support.redisserver import CachedStoreFactory, ProxyFactory, wait_for

pytestmark = pytest.mark.postgres

KEY = "Idempotency-Key"
SECRET = b"4242-4242-4242-4242"
BODY = b'{"card": "' + SECRET + b'"}'


async def _post(client: TestClient[Any, Any], body: bytes = BODY) -> tuple[int, str, bytes]:
    headers = {KEY: "k1", "Content-Type": "application/json", "Authorization": "Bearer alice"}
    async with client.post("/pay", data=body, headers=headers) as response:
        return response.status, response.headers.get("Idempotency-Error", ""), await response.read()


async def _entries(redis_client: Redis) -> dict[bytes, bytes]:
    """Every cache entry, name and bytes, read straight from Redis."""
    entries = {}
    for name in await redis_client.keys(f"{REDIS_JOB_PREFIX}*"):
        value = await redis_client.get(name)
        assert isinstance(name, bytes) and isinstance(value, bytes)
        entries[name] = value
    return entries


async def _sealed_and_cached(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis
) -> tuple[SealingStore, TestClient[Any, Any], bytes]:
    store = SealingStore(await make_store(), codec(OLD))
    client = await make_proxy(store)
    status, _, body = await _post(client)
    assert status == 201 and SECRET in body
    await wait_for(lambda: _any_entry(redis_client))
    store.record.calls.clear()  # type: ignore[attr-defined]
    return store, client, body


async def _any_entry(redis_client: Redis) -> bool:
    return bool(await _entries(redis_client))


async def test_redis_holds_only_sealed_bytes_and_a_hit_replays_them_opened(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    store, client, body = await _sealed_and_cached(make_store, make_proxy, redis_client)
    [entry] = (await _entries(redis_client)).values()
    assert entry.startswith(b"2") and b'"k":"k1"' in entry
    assert SECRET not in entry and b"application/json" not in entry  # body and headers sealed

    status, _, again = await _post(client)
    assert (status, again) == (201, body)
    assert store.record.calls == {}, "a hit must not touch the store"  # type: ignore[attr-defined]
    assert ledger.count("k1") == 1


async def test_a_tampered_entry_is_answered_from_the_store_and_never_forwarded(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    """Whoever can write to Redis can break an entry's seal, not the answer: the entry that
    does not open is dropped and the store of record's response replayed (SPEC §11)."""
    _, client, body = await _sealed_and_cached(make_store, make_proxy, redis_client)
    [(name, entry)] = (await _entries(redis_client)).items()
    flipped = bytearray(entry)
    flipped[-3] ^= 0x40
    await redis_client.set(name, bytes(flipped), keepttl=True)

    for _ in range(2):
        status, code, again = await _post(client)
        assert (status, code, again) == (201, "", body)
    assert ledger.count("k1") == 1
    # The tampered entry is gone; the store's copy is cached again in its place.
    await wait_for(lambda: _entry_is(redis_client, name, lambda value: value != bytes(flipped)))


async def test_an_entry_for_a_key_the_store_has_no_job_for_is_dropped_and_the_request_run(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    """An entry that does not open, for a key whose job the store of record no longer holds (a
    deleted job's entry put back, broken): not a 500 for every retry until it expires, but what
    the store alone would answer, a new key, run once (SPEC §11); the entry is gone."""
    store, client, _ = await _sealed_and_cached(make_store, make_proxy, redis_client)
    [(name, entry)] = (await _entries(redis_client)).items()
    [job] = await store.record.list_jobs()
    hooks, store.record.hooks = store.record.hooks, []  # deleted past the caches
    try:
        assert await store.record.delete(job, force=True)
    finally:
        store.record.hooks = hooks
    flipped = bytearray(entry)
    flipped[-3] ^= 0x40
    await redis_client.set(name, bytes(flipped))  # no expiry: it would stay for good

    status, code, body = await _post(client)
    assert (status, code) == (201, "") and SECRET in body
    assert ledger.count("k1") == 2  # once before the deletion, once now
    again = await _post(client)
    assert again[:2] == (201, "") and ledger.count("k1") == 2  # replayed: one execution
    await wait_for(lambda: _entry_is(redis_client, name, lambda value: value != bytes(flipped)))


async def test_an_entry_that_does_not_open_like_the_stores_own_copy_is_still_refused(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    """The store of record holds the same box, under a key this proxy's ring lacks: there is
    nothing better to answer with (SPEC §11, `500 response-unreadable`)."""
    store = SealingStore(await make_store(), codec(OLD))
    first = await make_proxy(store)
    assert (await _post(first))[0] == 201
    await wait_for(lambda: _any_entry(redis_client))
    other = await make_proxy(SealingStore(store.inner, codec(OTHER)))
    for _ in range(2):
        status, code, body = await _post(other)
        assert (status, code) == (500, "response-unreadable")
        assert SECRET not in body
    assert ledger.count("k1") == 1


async def _entry_is(redis_client: Redis, name: bytes, test: Any) -> bool:
    value = await redis_client.get(name)
    return value is not None and bool(test(value))


async def test_a_payload_mismatch_is_answered_before_any_decryption(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    # The proxy's ring lacks the entry's key: opening it would be 500. Another payload is 409
    # all the same, so the box was never opened for it.
    store = SealingStore(await make_store(), codec(OLD))
    first = await make_proxy(store)
    assert (await _post(first))[0] == 201
    await wait_for(lambda: _any_entry(redis_client))
    other = await make_proxy(SealingStore(store.inner, codec(OTHER)))
    assert (await _post(other, b'{"card": "other"}'))[:2] == (409, "payload-mismatch")
    assert (await _post(other))[:2] == (500, "response-unreadable")
    assert ledger.count("k1") == 1


async def test_reseal_drops_the_entry_that_holds_the_old_box(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis
) -> None:
    store, _, _ = await _sealed_and_cached(make_store, make_proxy, redis_client)
    ring = codec(NEW, OLD)
    report = await reseal_store(store.record, ring, batch_size=10)
    assert report.responses.resealed == 1
    await wait_for(lambda: _no_entry(redis_client))  # the old key may be retired next


async def _no_entry(redis_client: Redis) -> bool:
    return not await _entries(redis_client)
