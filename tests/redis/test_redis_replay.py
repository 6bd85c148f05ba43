"""SPEC §7, §11: replays answered from Redis, exactly as from the store, without reading it."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict
from redis.asyncio import Redis

from idemproxy.admin.app import Readiness, create_admin_app
from idemproxy.cli import main as cli
from idemproxy.config.settings import load_settings
from idemproxy.constants import REDIS_GONE_PREFIX
from idemproxy.core.types import Claimed, Existing, Intent, JobState, StoredResponse
from idemproxy.proxy.app import create_app
from idemproxy.store.base import AttemptFailure
from idemproxy.store.redis.client import EntryKeys
from idemproxy.store.redis.codec import encode, entry_name, tombstone_name, watch_name
from tests.support.backend import Ledger
from tests.support.redisserver import (
    CachedStoreFactory,
    ProxyFactory,
    RedisServer,
    cached_entries,
    wait_for,
)

pytestmark = pytest.mark.postgres

KEY = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"
# The stored response includes a Location, an ETag and a JSON body that names the execution.
END_TO_END = ("Content-Type", "Location", "ETag", "Idempotency-Job")


async def _post(
    client: TestClient[Any, Any], key: str, body: bytes = b'{"amount": 1}', path: str = "/pay"
) -> tuple[int, CIMultiDict[str], bytes]:
    headers = {KEY: key, "Content-Type": "application/json", "Authorization": "Bearer alice"}
    async with client.post(path, data=body, headers=headers) as response:
        return response.status, response.headers.copy(), await response.read()


async def _cached_once(
    make_store: CachedStoreFactory,
    make_proxy: ProxyFactory,
    redis_client: Redis,
    key: str = "k1",
    path: str = "/pay",
    **settings: Any,
) -> tuple[Any, TestClient[Any, Any], tuple[int, CIMultiDict[str], bytes]]:
    """A proxy on a cached store, one executed request, and its completion cached in Redis."""
    store = await make_store()
    client = await make_proxy(store, **settings)
    first = await _post(client, key, path=path)
    assert first[0] == 201 and REPLAYED not in first[1]
    await wait_for(lambda: _has_entries(redis_client))
    store.inner.calls.clear()
    return store, client, first


async def _has_entries(client: Redis) -> bool:
    return await cached_entries(client) > 0


async def test_a_hit_replays_byte_identically_without_reading_the_store(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    store, client, (status, headers, body) = await _cached_once(
        make_store, make_proxy, redis_client
    )
    for _ in range(3):
        again_status, again_headers, again_body = await _post(client, "k1")
        assert again_status == status
        assert again_body == body  # byte-identical
        assert again_headers[REPLAYED] == "true"
        for name in END_TO_END:
            assert again_headers[name] == headers[name], name
    assert store.inner.calls == {}, "a cache hit must not touch the store"
    assert ledger.count("k1") == 1


async def test_a_different_payload_is_a_mismatch_from_the_cache_too(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    store, client, _ = await _cached_once(make_store, make_proxy, redis_client)
    status, headers, _ = await _post(client, "k1", body=b'{"amount": 2}')
    assert status == 409
    assert headers["Idempotency-Error"] == "payload-mismatch"
    assert store.inner.calls == {}
    assert ledger.count("k1") == 1


async def test_another_owner_never_gets_the_cached_response(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    _store, client, _ = await _cached_once(make_store, make_proxy, redis_client)
    headers = {KEY: "k1", "Content-Type": "application/json", "Authorization": "Bearer bob"}
    async with client.post("/pay", data=b'{"amount": 1}', headers=headers) as response:
        assert response.status == 201
        assert REPLAYED not in response.headers
    assert ledger.count("k1") == 2  # SPEC §5: two owners, two jobs


async def test_a_body_too_large_to_store_replays_as_omitted_from_the_cache(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis
) -> None:
    store, client, _ = await _cached_once(
        make_store, make_proxy, redis_client, path="/big?size=5000", max_stored_body=1000
    )
    status, headers, body = await _post(client, "k1", path="/big?size=5000")
    assert (status, body) == (201, b"")
    assert headers["Idempotency-Replay"] == "omitted"
    assert store.inner.calls == {}


async def test_a_store_read_of_a_completed_job_fills_the_cache_again(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis
) -> None:
    store, client, first = await _cached_once(make_store, make_proxy, redis_client)
    await redis_client.flushall()  # e.g. Redis restarted, or the entry's ttl ran out
    assert (await _post(client, "k1"))[2] == first[2]
    assert store.inner.calls["claim"] == 1  # the miss went to the store …
    await wait_for(lambda: _has_entries(redis_client))  # … and the answer was cached
    store.inner.calls.clear()
    assert (await _post(client, "k1"))[2] == first[2]
    assert store.inner.calls == {}


async def test_deleting_a_job_invalidates_it_and_refuses_a_late_cache_write(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    store, client, _ = await _cached_once(make_store, make_proxy, redis_client)
    [listed] = await store.record.list_jobs()
    job = await store.record.get_by_id(listed.id)
    assert job is not None and job.state is JobState.COMPLETED

    assert await store.record.delete(job)  # an operator's, on the store of record
    assert await cached_entries(redis_client) == 0
    name = entry_name(job.owner, job.key)
    gone = await redis_client.pttl(tombstone_name(name, job.id))
    assert gone > (job.expires_at.timestamp() - time.time() - 5) * 1000
    assert (await redis_client.keys(f"{REDIS_GONE_PREFIX}*")) != []

    # A write of the deleted job that was already on its way lands now: refused.
    keys = EntryKeys(name, tombstone_name(name, job.id), watch_name(name))
    store.cache.put(keys, encode(job), 60, "")
    await store.cache.drain()
    assert await cached_entries(redis_client) == 0

    status, headers, _ = await _post(client, "k1")
    assert status == 201 and REPLAYED not in headers  # a new job, never the deleted one
    assert ledger.count("k1") == 2


async def test_lookups_are_timed_through_the_store_metrics_hook(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis
) -> None:
    store, client, _ = await _cached_once(make_store, make_proxy, redis_client)
    seen: list[str] = []
    store.record.observer = lambda operation, _seconds, _failed: seen.append(operation)
    # A claim that succeeds is timed straight into its own series (observe/metrics.py).
    store.record.claim_seconds = lambda _seconds: seen.append("claim")
    assert store.observer is store.record.observer  # the store's statements are timed too
    await _post(client, "k1")
    await _post(client, "k2")
    assert seen[:2] == ["redis_hit", "redis_miss"]
    assert "claim" in seen


async def test_the_app_builds_the_cached_store_from_its_settings(
    backend_url: str, pg_dsn: str, redis_server: RedisServer, redis_client: Redis, ledger: Ledger
) -> None:
    # The defaults (50 ms a lookup, 0.5 s a write) take a Redis that a loaded machine delays for
    # one that is down, and bypass it for a while: this test is not about that.
    redis = {"url": redis_server.url, "timeout": 10.0, "write_timeout": 10.0}
    settings = load_settings(upstream=backend_url, store=pg_dsn, redis=redis)
    async with TestClient(TestServer(create_app(settings))) as client:
        first = await _post(client, "k1")
        await wait_for(lambda: _has_entries(redis_client))
        again = await _post(client, "k1")
    assert again[1][REPLAYED] == "true" and again[2] == first[2]
    assert ledger.count("k1") == 1


async def test_the_jobs_cli_deletes_through_the_cache_when_given_redis(
    make_store: CachedStoreFactory,
    make_proxy: ProxyFactory,
    redis_server: RedisServer,
    redis_client: Redis,
    pg_dsn: str,
    ledger: Ledger,
) -> None:
    store, client, _ = await _cached_once(make_store, make_proxy, redis_client)
    [job] = await store.record.list_jobs()
    argv = ["jobs", "delete", job.id, "--store", pg_dsn, "--redis", redis_server.url]
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert await cached_entries(redis_client) == 0
    assert await redis_client.keys(f"{REDIS_GONE_PREFIX}*") != []
    status, headers, _ = await _post(client, "k1")
    assert status == 201 and REPLAYED not in headers
    assert ledger.count("k1") == 2


async def test_a_cli_delete_that_redis_does_not_take_fails_and_names_the_entry(
    make_store: CachedStoreFactory,
    make_proxy: ProxyFactory,
    redis_server: RedisServer,
    redis_client: Redis,
    pg_dsn: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SPEC §11, Erasure: the job is gone from the store, but Redis still holds its entry and
    the CLI, unlike a proxy, does not stay to invalidate it later: it says so, naming the entry
    to remove, and fails (an erasure script must not report success)."""
    store, _, _ = await _cached_once(make_store, make_proxy, redis_client)
    [job] = await store.record.list_jobs()
    redis_server.stop()
    argv = ["jobs", "delete", job.id, "--store", pg_dsn, "--redis", redis_server.url]
    assert await asyncio.to_thread(cli.main, argv) == 1
    assert await store.record.get_by_id(job.id) is None  # the store's delete is made
    err = capsys.readouterr().err
    assert "Redis did not take the invalidation of 1 cache entries" in err
    remedy = f"redis-cli -h 127.0.0.1 -p {redis_server.port} -n 0 unlink"
    assert f"{remedy} {entry_name(job.owner, job.key)}" in err


async def test_the_admin_api_answers_202_naming_the_entries_redis_did_not_take(
    make_store: CachedStoreFactory,
    make_proxy: ProxyFactory,
    redis_server: RedisServer,
    redis_client: Redis,
    pg_dsn: str,
) -> None:
    """SPEC §11, Erasure: a delete or purge through the admin API whose Redis invalidation did
    not go through is made in the store but not whole: 202 with the entries, not 204 or 200 (a
    proxy that stops before Redis is back leaves them to be replayed by the others)."""
    store, client, _ = await _cached_once(make_store, make_proxy, redis_client)
    await _post(client, "k2")
    [second, first] = await store.record.list_jobs()
    settings = load_settings(upstream="http://127.0.0.1:9", store=pg_dsn)
    admin_app = create_admin_app(settings, store.record, Readiness(), invalidations=store.cache)
    async with TestClient(TestServer(admin_app)) as admin:
        redis_server.stop()
        deleting = asyncio.create_task(_delete(admin, first.id))
        await asyncio.sleep(0.3)  # while it waits for Redis, another change's entry is pending
        store.cache.drop_soon(entry_name("bob", "k9"), tombstone_name("x", "y"))
        status, deleted = await deleting
        assert status == 202
        assert deleted["redis_entries_pending"] == [entry_name(first.owner, first.key)]
        async with admin.post("/owners/purge", json={"owner": second.owner}) as purged:
            report = await purged.json()
        assert purged.status == 202 and report["removed_jobs"] == 1
        # Its own entry only: the delete's, still pending too, is not this erasure's.
        assert report["redis_entries_pending"] == [entry_name(second.owner, second.key)]
        redis_server.start()
        async with admin.post("/owners/purge", json={"owner": second.owner}) as again:
            assert again.status == 200  # the entries went through once Redis was back
            assert (await again.json())["redis_entries_pending"] == []


async def _delete(admin: TestClient[Any, Any], job_id: str) -> tuple[int, Any]:
    async with admin.delete(f"/jobs/{job_id}") as deleted:
        return deleted.status, await deleted.json()


async def test_a_cached_completion_counts_the_hedges_of_the_version_that_won(
    make_store: CachedStoreFactory, redis_client: Redis
) -> None:
    """A late attempt of an older version ending (its CAS lost) must not make the cache forget
    the attempts hedged under the version in flight now: the entry is the job as stored."""
    store = await make_store()
    intent = Intent("alice", "k1", "fp1", "POST", "/pay")
    claimed = await store.claim(intent, str(uuid.uuid4()), "primary", ttl=3600.0, lease=60.0)
    assert isinstance(claimed, Claimed)
    following = await store.fail_over(
        claimed.job, 1, "f1", failure=AttemptFailure(503, None), lease=60.0
    )
    assert following is not None
    assert await store.add_attempt(following.job, "hedge", lease=60.0) == 3
    assert not await store.settle(claimed.job, 1, JobState.UNKNOWN, error="late timeout")
    response = StoredResponse(201, (("Content-Type", "application/json"),), b"{}")
    assert await store.complete(following.job, 2, response, ttl=3600.0)
    await wait_for(lambda: _has_entries(redis_client))
    store.inner.calls.clear()

    duplicate = await store.claim(intent, str(uuid.uuid4()), "primary", ttl=3600.0, lease=60.0)
    assert isinstance(duplicate, Existing) and not store.inner.calls  # answered from Redis
    stored = await store.inner.get("alice", "k1")
    assert stored is not None and duplicate.job.attempt_count == stored.attempt_count == 3


async def test_another_owners_entry_copied_under_this_keys_name_is_a_miss(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis, ledger: Ledger
) -> None:
    """SPEC §5, §11: whoever can write to Redis copies Alice's entry under the name of Bob's;
    Bob's retry is answered from the store, with Bob's own response, never Alice's."""
    store, client, alices = await _cached_once(make_store, make_proxy, redis_client)
    bob = {KEY: "k1", "Content-Type": "application/json", "Authorization": "Bearer bob"}
    async with client.post("/pay", data=b'{"amount": 1}', headers=bob) as response:
        bobs = await response.read()
    await wait_for(lambda: _entries_at_least(redis_client, 2))
    [alice_entry, bob_entry] = [entry_name(job.owner, job.key) for job in await _by_owner(store)]
    copied = await redis_client.get(alice_entry)
    assert copied is not None
    await redis_client.set(bob_entry, copied)
    store.inner.calls.clear()
    async with client.post("/pay", data=b'{"amount": 1}', headers=bob) as response:
        assert response.status == 201 and response.headers[REPLAYED] == "true"
        assert await response.read() == bobs != alices[2]
    assert store.inner.calls["claim"] == 1  # the entry was a miss: the store answered
    assert ledger.count("k1") == 2


async def test_a_value_of_another_type_under_an_entrys_name_is_a_miss_for_that_key_alone(
    make_store: CachedStoreFactory, make_proxy: ProxyFactory, redis_client: Redis
) -> None:
    """A reply error about one key (WRONGTYPE) is not an outage: the other keys' entries keep
    being served from Redis, and the next write of that key replaces the value."""
    store, client, first = await _cached_once(make_store, make_proxy, redis_client)
    wrong = entry_name("some-owner", "some-key")
    await redis_client.hset(wrong, "f", "v")
    for _ in range(3):
        assert await store.cached("some-owner", "some-key") is None
        store.inner.calls.clear()
        assert (await _post(client, "k1"))[2] == first[2]
        assert store.inner.calls == {}  # served from Redis: the cache was not turned off


async def _entries_at_least(client: Redis, count: int) -> bool:
    return await cached_entries(client) >= count


async def _by_owner(store: Any) -> list[Any]:
    """The two completed jobs of key k1, Alice's first (the owner is a hash of the credential)."""
    jobs = await store.record.list_jobs()
    alice = hashlib.sha256(b"Bearer alice").hexdigest()
    return sorted(jobs, key=lambda job: job.owner != alice)
