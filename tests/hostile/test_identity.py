"""SPEC §4, §5, §7, §10: hostile keys and identities.

* Invalid keys are refused before any storage call: proved with `CountingStore`, the real SQLite
  store recording every hot-path call (tests/hostile/conftest.py).
* Keys full of SQL and LIKE metacharacters are valid visible ASCII: stored and matched literally
  on both stores, never interpreted.
* The proxy's own headers cannot be forged from either side.
* `Connection: Authorization` strips the credential the job is scoped by (what the code does,
  and why no response can cross owners because of it).
* Whether another owner holds a key changes nothing in what the store is asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from idemproxy.core.types import JobState
from idemproxy.identity.intent import hash_credential
from idemproxy.store.base import Store
from tests.support.backend import Ledger
from tests.support.faultproxy import FaultProxy, replace
from tests.support.proxyapp import ProxyFactory
from tests.support.proxychecks import ATTEMPT, JOB, KEY, REPLAYED, wait_for_jobs

from .conftest import CountingStore, ListeningProxy


async def exchange(address: tuple[str, int], data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def post_with(key_lines: bytes) -> bytes:
    return (
        b"POST /pay HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer alice\r\n"
        + key_lines
        + b"Content-Length: 3\r\nConnection: close\r\n\r\npay"
    )


INVALID_KEYS = {
    "empty": b"Idempotency-Key: \r\n",
    "empty-quoted": b'Idempotency-Key: ""\r\n',
    "256-characters": b"Idempotency-Key: " + b"k" * 256 + b"\r\n",
    "non-ascii": "Idempotency-Key: cl\u00e9\r\n".encode(),
    "tab": b"Idempotency-Key: a\tb\r\n",
    "inner-space": b"Idempotency-Key: a b\r\n",
    "cr": b"Idempotency-Key: a\rb\r\n",
    "lf": b"Idempotency-Key: a\nb\r\n",
    "nul": b"Idempotency-Key: a\x00b\r\n",
    "del": b"Idempotency-Key: a\x7fb\r\n",
    "unbalanced-open": b'Idempotency-Key: "abc\r\n',
    "unbalanced-close": b'Idempotency-Key: abc"\r\n',
    "quote-inside": b'Idempotency-Key: "a"b"\r\n',
    "bad-escape": b'Idempotency-Key: "a\\qb"\r\n',
    "two-headers": b"Idempotency-Key: a\r\nIdempotency-Key: b\r\n",
    "two-equal-headers": b"Idempotency-Key: a\r\nIdempotency-Key: a\r\n",
    "comma-joined": b"Idempotency-Key: a, b\r\n",
    "comma-joined-quoted": b'Idempotency-Key: "a", "b"\r\n',
    # RFC 8941 lets an sf-string hold spaces, SPEC §4 does not (visible ASCII only): with
    # spaces, the classic injection is refused before it could reach any SQL at all.
    "sql-with-spaces": b'Idempotency-Key: "\'; DROP TABLE jobs; --"\r\n',
}


@pytest.mark.parametrize("case", INVALID_KEYS)
async def test_an_invalid_key_is_400_before_any_storage_call(
    listening_proxy: ListeningProxy, counting_store: CountingStore, ledger: Ledger, case: str
) -> None:
    address = await listening_proxy(inject_store=counting_store)
    answer = await exchange(address, post_with(INVALID_KEYS[case]))
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split(b" ")[1] == b"400", answer[:200]
    # Either ours (key-invalid) or the HTTP parser's, for bytes no header may carry.
    assert b"Idempotency-Error: key-invalid" in rest or case in ("cr", "lf", "nul", "del")
    assert counting_store.calls == []
    assert ledger.count() == 0


METACHARACTER_KEYS = [
    "abc",  # first, so that a key interpreted as a pattern would find it
    "%",
    "_bc",
    "a%",
    "ab_",
    "%_",
    "';DROP/**/TABLE/**/jobs;--",
    "'OR'1'='1",
    "'",
    "''",
    "\\'",  # sent quoted: "\\'"
    'a"b',  # sent quoted: "a\"b"
    "$1",
    "?",
    "--",
    "/*",
    "*/",
    ";",
    "[a-z]",
    "{}",
    "1+OR+1=1",
]


def header_value(key: str) -> str:
    """RFC 8941 sf-string for keys a bare token cannot carry (SPEC §4)."""
    if any(c in key for c in '"\\,'):
        return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return key


async def test_sql_and_like_metacharacters_are_keys_like_any_other(
    proxy: ProxyFactory, ledger: Ledger, jobs: Store
) -> None:
    client = await proxy()
    bodies: dict[str, bytes] = {}
    for key in METACHARACTER_KEYS:
        headers = {KEY: header_value(key), "Authorization": "Bearer alice"}
        async with client.post("/pay", data=b"pay", headers=headers) as first:
            assert (first.status, first.headers.get(REPLAYED)) == (201, None), key
            bodies[key] = await first.read()
    for key in METACHARACTER_KEYS:
        headers = {KEY: header_value(key), "Authorization": "Bearer alice"}
        async with client.post("/pay", data=b"pay", headers=headers) as again:
            assert again.headers[REPLAYED] == "true", key
            assert await again.read() == bodies[key]  # its own response, no other key's
    # Each ran once; the backend sees the header as sent (quoted where it had to be).
    assert [ledger.count(header_value(key)) for key in METACHARACTER_KEYS] == [1] * len(
        METACHARACTER_KEYS
    )
    owner = hash_credential("Bearer alice")
    for key in METACHARACTER_KEYS:
        job = await jobs.get(owner, key)
        assert job is not None and job.key == key and job.state is JobState.COMPLETED
    stored = await jobs.list_jobs(limit=1000)
    assert sorted(job.key for job in stored) == sorted(METACHARACTER_KEYS)  # tables intact


async def test_forged_proxy_headers_never_reach_the_backend_in_any_spelling(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """tests/proxy/test_replay.py forges each header once; here in odd cases and repeated."""
    client = await proxy()
    forged = [
        ("idempotency-job", "forged-1"),
        ("IDEMPOTENCY-JOB", "forged-2"),
        ("Idempotency-Attempt", "99"),
        ("idempotent-replayed", "true"),
        ("IDEMPOTENT-REPLAYED", "true"),
        ("Idempotency-Replay", "omitted"),
    ]
    for expected_replay in (None, "true"):
        async with client.post("/pay", data=b"x", headers=[(KEY, "forge"), *forged]) as answer:
            assert answer.headers.getall(REPLAYED, []) == (
                [expected_replay] if expected_replay else []
            )
            assert "Idempotency-Replay" not in answer.headers
            job_id = answer.headers[JOB]
    (execution,) = ledger.executions
    seen = [(name.lower(), value) for name, value in execution.headers]
    assert [v for n, v in seen if n == JOB.lower()] == [job_id]
    assert [v for n, v in seen if n == ATTEMPT.lower()] == ["1"]
    assert not [n for n, _ in seen if n in ("idempotent-replayed", "idempotency-replay")]


async def test_an_upstream_cannot_forge_the_proxy_headers_either(
    make_proxy: ProxyFactory, fault_proxy: FaultProxy, sqlite_dsn: str
) -> None:
    client = await make_proxy(store=sqlite_dsn, upstream=fault_proxy.url)
    fault_proxy.inject(
        replace(
            b"HTTP/1.1 201 Created\r\nIdempotent-Replayed: true\r\nIdempotency-Job: forged\r\n"
            b"Idempotency-Replay: omitted\r\nContent-Length: 2\r\n\r\nok"
        )
    )
    async with client.post("/pay", data=b"x", headers={KEY: "up"}) as first:
        assert first.status == 201
        assert REPLAYED not in first.headers and "Idempotency-Replay" not in first.headers
        assert first.headers.getall(JOB) != ["forged"] and len(first.headers.getall(JOB)) == 1
    async with client.post("/pay", data=b"x", headers={KEY: "up"}) as replay:
        assert replay.headers.getall(REPLAYED) == ["true"]
        assert "Idempotency-Replay" not in replay.headers
        assert replay.headers.getall(JOB) == first.headers.getall(JOB)


@pytest.mark.parametrize(
    ("strategy", "connection"),
    [
        ("authorization", "Authorization"),
        ("authorization", "keep-alive, authorization"),
        ("header:X-User", "X-User"),
        ("authorization", "Idempotency-Key"),
    ],
)
async def test_connection_may_not_hide_the_identity_the_job_is_scoped_by(
    make_proxy: ProxyFactory,
    sqlite_dsn: str,
    sqlite_jobs: Store,
    ledger: Ledger,
    strategy: str,
    connection: str,
) -> None:
    """The owner and the key are read before hop-by-hop stripping (SPEC §10); a `Connection`
    header naming them would have the backend see another identity than the job's (with a
    gateway-set `header:X-User`, the trusted header would vanish). It is refused, before any
    storage call."""
    client = await make_proxy(store=sqlite_dsn, owner={"strategy": strategy})
    tricky = {
        KEY: "conn",
        "Authorization": "Bearer alice",
        "X-User": "alice",
        "Connection": connection,
    }
    async with client.post("/pay", data=b"x", headers=tricky) as refused:
        assert refused.status == 400
        assert refused.headers["Idempotency-Error"] == "header-invalid"
    assert await sqlite_jobs.list_jobs() == []
    assert ledger.count("conn") == 0
    plain = {KEY: "conn", "Authorization": "Bearer alice", "X-User": "alice"}
    async with client.post("/pay", data=b"x", headers=plain) as allowed:
        assert allowed.status == 201
        seen_by_backend = {n.lower() for n, _ in json.loads(await allowed.read())["headers"]}
    assert {"authorization", KEY.lower()} <= seen_by_backend


async def _store_calls_for(
    client: Any, store: CountingStore, headers: dict[str, str]
) -> tuple[list[str], str]:
    store.calls.clear()
    async with client.post("/pay", data=b"x", headers=headers) as response:
        assert response.status == 201 and REPLAYED not in response.headers
        assert "Idempotency-Error" not in response.headers
    return list(store.calls), store.intents[-1].owner


async def test_a_key_held_by_another_owner_looks_exactly_like_a_fresh_key(
    make_proxy: ProxyFactory, counting_store: CountingStore, ledger: Ledger
) -> None:
    """No timing oracle: both are a claim in the requester's own scope, the same store calls
    in the same order, the same answer; wall-clock time is not measured, the path is."""
    client = await make_proxy(inject_store=counting_store, store="sqlite:///unused.db")
    alice = {"Authorization": "Bearer alice"}
    bob = {"Authorization": "Bearer bob"}
    async with client.post("/pay", data=b"x", headers={KEY: "taken", **alice}) as response:
        assert response.status == 201

    held, held_owner = await _store_calls_for(client, counting_store, {KEY: "taken", **bob})
    fresh, fresh_owner = await _store_calls_for(client, counting_store, {KEY: "fresh", **bob})
    assert held == fresh == ["claim", "complete"]
    assert held_owner == fresh_owner == hash_credential("Bearer bob")

    # And while alice's request with the key is still in flight:
    slow = asyncio.ensure_future(
        client.post("/pay?delay=1.5", data=b"x", headers={KEY: "busy", **alice})
    )
    await wait_for_jobs(counting_store, 4)
    in_flight, _ = await _store_calls_for(client, counting_store, {KEY: "busy", **bob})
    assert in_flight == fresh
    assert (await slow).status == 201
    assert ledger.count("busy") == 2 and ledger.count("taken") == 2
