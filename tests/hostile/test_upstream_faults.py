"""SPEC §3.2, §7, §10: every way an upstream exchange can break, through the fault relay
(tests/support/faultproxy.py).

The recording backend really executes whatever the relay forwards, so each case checks three
things: what the first client gets, the job's state (`released` only where nothing can have
executed), and the backend's ledger (at most one execution per key; a retry of an `unknown` job
never runs it again).
"""

from __future__ import annotations

import asyncio
import gzip
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from idemproxy.core.types import AttemptState, Job, JobState, KeptResponse
from idemproxy.store.base import Store
from idemproxy.store.sqlite.store import SqliteStore
from tests.support.backend import Ledger
from tests.support.faultproxy import (
    RESET_BEFORE_RESPONSE,
    RESET_ON_ACCEPT,
    FaultProxy,
    drip,
    replace,
    reset_mid_body,
    trail,
)
from tests.support.proxyapp import ProxyFactory
from tests.support.proxychecks import KEY, REPLAYED, assert_problem, only_job

Client = TestClient[Any, Any]


@pytest.fixture
async def client(make_proxy: ProxyFactory, fault_proxy: FaultProxy, sqlite_dsn: str) -> Client:
    return await make_proxy(store=sqlite_dsn, upstream=fault_proxy.url, upstream_timeout=2.0)


async def post(client: Client, key: str, path: str = "/charge") -> aiohttp.ClientResponse:
    response = await client.post(path, data=b"pay", headers={KEY: key})
    await response.read()
    return response


async def assert_unknown_for_good(
    client: Client, jobs: Store, ledger: Ledger, key: str, path: str = "/charge"
) -> None:
    """SPEC §3.2: the job is unknown, and retrying it runs nothing (409 outcome-unknown)."""
    job = await only_job(jobs)
    assert job.state is JobState.UNKNOWN
    assert [a.state for a in job.attempts] == [AttemptState.UNKNOWN]
    executions = ledger.count(key)
    for _ in range(2):
        await assert_problem(await post(client, key, path), "outcome-unknown", 409)
    assert ledger.count(key) == executions <= 1
    assert (await only_job(jobs)).attempt_count == 1


async def test_refused_before_any_byte_releases_and_the_retry_runs_once(
    make_proxy: ProxyFactory,
    fault_proxy: FaultProxy,
    sqlite_dsn: str,
    sqlite_jobs: Store,
    ledger: Ledger,
) -> None:
    client = await make_proxy(store=sqlite_dsn, upstream=fault_proxy.url)
    await fault_proxy.refuse()
    await assert_problem(await post(client, "refused"), "upstream-unavailable", 502)
    job = await only_job(sqlite_jobs)
    assert (job.state, [a.state for a in job.attempts]) == (
        JobState.RELEASED,
        [AttemptState.FAILED],
    )
    assert ledger.count() == 0

    await fault_proxy.start()  # same port, listening again
    first = await post(client, "refused")
    assert first.status == 201
    again = await post(client, "refused")
    assert again.headers[REPLAYED] == "true"
    assert ledger.count("refused") == 1
    job = await only_job(sqlite_jobs)
    assert (job.state, job.attempt_count) == (JobState.COMPLETED, 2)


async def test_reset_on_accept_is_unknown_though_nothing_ran(
    client: Client, fault_proxy: FaultProxy, sqlite_jobs: Store, ledger: Ledger
) -> None:
    """Once the connection is up the request may have been written: the proxy cannot prove
    that nothing executed, and does not guess (SPEC §3.2). Only if the reset lands while the
    connection is still being set up (connect itself fails) is the job released."""
    fault_proxy.inject(RESET_ON_ACCEPT)
    await assert_problem(await post(client, "rst-accept"), "upstream-unavailable", 502)
    assert fault_proxy.exchanges == []
    if (await only_job(sqlite_jobs)).state is JobState.RELEASED:  # rare: connect failed
        assert (await post(client, "rst-accept")).status == 201
        assert ledger.count("rst-accept") == 1
        return
    await assert_unknown_for_good(client, sqlite_jobs, ledger, "rst-accept")
    assert ledger.count() == 0


async def test_reset_after_the_request_was_sent_is_unknown(
    client: Client, fault_proxy: FaultProxy, sqlite_jobs: Store, ledger: Ledger
) -> None:
    fault_proxy.inject(RESET_BEFORE_RESPONSE)
    await assert_problem(await post(client, "rst-sent"), "upstream-unavailable", 502)
    assert ledger.count("rst-sent") == 1  # it did run: that is why the job is unknown
    await assert_unknown_for_good(client, sqlite_jobs, ledger, "rst-sent")


async def test_reset_mid_body_of_a_stored_size_response_is_unknown(
    client: Client, fault_proxy: FaultProxy, sqlite_jobs: Store, ledger: Ledger
) -> None:
    fault_proxy.inject(reset_mid_body(after=5))
    await assert_problem(await post(client, "rst-body"), "upstream-unavailable", 502)
    assert ledger.count("rst-body") == 1
    await assert_unknown_for_good(client, sqlite_jobs, ledger, "rst-body")


async def test_reset_mid_body_of_a_streamed_response_cuts_the_client_off_and_is_unknown(
    make_proxy: ProxyFactory,
    fault_proxy: FaultProxy,
    sqlite_dsn: str,
    sqlite_jobs: Store,
    ledger: Ledger,
) -> None:
    client = await make_proxy(store=sqlite_dsn, upstream=fault_proxy.url, max_stored_body=1000)
    fault_proxy.inject(reset_mid_body(after=3000))
    async with client.post("/export?size=20000", data=b"pay", headers={KEY: "rst-stream"}) as first:
        assert first.status == 201  # the status line was out before the body broke
        with pytest.raises(aiohttp.ClientPayloadError):
            await first.read()
    await assert_unknown_for_good(client, sqlite_jobs, ledger, "rst-stream", "/export?size=20000")


async def test_slow_drip_within_the_timeout_arrives_whole_and_is_replayed(
    client: Client, fault_proxy: FaultProxy, sqlite_jobs: Store, ledger: Ledger
) -> None:
    fault_proxy.inject(drip(size=40, delay=0.02))
    first = await post(client, "drip")
    assert first.status == 201
    sent = fault_proxy.exchanges[0].response
    assert sent is not None and sent.endswith(await first.read())
    replay = await post(client, "drip")
    assert replay.headers[REPLAYED] == "true"
    assert await replay.read() == await first.read()
    assert ledger.count("drip") == 1
    assert (await only_job(sqlite_jobs)).state is JobState.COMPLETED


async def test_slow_drip_past_the_upstream_timeout_is_504_and_unknown(
    make_proxy: ProxyFactory,
    fault_proxy: FaultProxy,
    sqlite_dsn: str,
    sqlite_jobs: Store,
    ledger: Ledger,
) -> None:
    client = await make_proxy(store=sqlite_dsn, upstream=fault_proxy.url, upstream_timeout=0.3)
    fault_proxy.inject(drip(size=8, delay=0.1))
    await assert_problem(await post(client, "trickle"), "upstream-timeout", 504)
    assert ledger.count("trickle") == 1
    await assert_unknown_for_good(client, sqlite_jobs, ledger, "trickle")


OK_HEAD = b"HTTP/1.1 201 Created\r\n"


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(OK_HEAD + b"Bad Header Line\r\nContent-Length: 2\r\n\r\nok", id="no-colon"),
        pytest.param(OK_HEAD + b"X-A: a\x00b\r\nContent-Length: 2\r\n\r\nok", id="nul-in-value"),
        pytest.param(OK_HEAD + b"X-A : b\r\nContent-Length: 2\r\n\r\nok", id="space-before-colon"),
        pytest.param(
            OK_HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\nok", id="two-lengths"
        ),
        pytest.param(
            OK_HEAD
            + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            id="length-and-chunked",
        ),
        pytest.param(b"HTTP/1.1 2011 Created\r\nContent-Length: 2\r\n\r\nok", id="bad-status"),
        pytest.param(OK_HEAD + b"Content-Length: 100\r\n\r\nshort", id="length-lies-short"),
        pytest.param(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhel", id="chunk-cut-off"),
    ],
)
async def test_malformed_or_cut_off_response_is_502_and_unknown(
    client: Client, fault_proxy: FaultProxy, sqlite_jobs: Store, ledger: Ledger, answer: bytes
) -> None:
    fault_proxy.inject(replace(answer))  # the backend did execute; what came back is broken
    await assert_problem(await post(client, "bad"), "upstream-unavailable", 502)
    assert ledger.count("bad") == 1
    await assert_unknown_for_good(client, sqlite_jobs, ledger, "bad")


@pytest.mark.parametrize(
    "answer",
    [
        # RFC 9112 §5.2: a recipient of obs-fold in a response replaces it with SP.
        pytest.param(OK_HEAD + b"X-A: a\r\n folded\r\nContent-Length: 2\r\n\r\nok", id="obs-fold"),
        # RFC 9112 §2.2: a recipient may accept a bare LF as a line terminator.
        pytest.param(b"HTTP/1.1 201 Created\nContent-Length: 2\n\nok", id="bare-lf"),
        # RFC 9112 §6.3: no length, no chunking: the body ends when the connection closes.
        pytest.param(OK_HEAD + b"\r\nok", id="close-delimited"),
    ],
)
async def test_lenient_but_complete_response_is_stored(
    client: Client, fault_proxy: FaultProxy, sqlite_jobs: Store, answer: bytes
) -> None:
    fault_proxy.inject(replace(answer))
    first = await post(client, "lenient")
    assert (first.status, await first.read()) == (201, b"ok")
    replay = await post(client, "lenient")
    assert (replay.headers[REPLAYED], await replay.read()) == ("true", b"ok")
    assert (await only_job(sqlite_jobs)).state is JobState.COMPLETED


FORGED = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nX-Forged: 1\r\n\r\nforged"


@pytest.mark.parametrize("extra", [FORGED, b"JUNK"], ids=["a-whole-forged-response", "junk"])
async def test_length_that_lies_long_never_leaks_into_the_next_request(
    client: Client,
    fault_proxy: FaultProxy,
    sqlite_jobs: Store,
    ledger: Ledger,
    extra: bytes,
) -> None:
    """Bytes after the declared body stay on the first exchange: the pooled connection is not
    reused, and the next key gets its own answer, never the extra bytes (response desync)."""
    fault_proxy.inject(replace(OK_HEAD + b"Content-Length: 5\r\n\r\nhello" + extra, keep_open=True))
    first = await post(client, "long")
    second = await post(client, "next")
    assert second.status == 201 and "X-Forged" not in second.headers
    assert b'"execution": 2' in await second.read()
    assert fault_proxy.connections == 2
    jobs = {job.key: job.state for job in await sqlite_jobs.list_jobs()}
    if first.status == 201:  # the declared body was whole: stored as declared
        assert await first.read() == b"hello"
        assert jobs == {"long": JobState.COMPLETED, "next": JobState.COMPLETED}
    else:  # or the trailing junk broke the exchange: then it is unknown, never guessed
        await assert_problem(first, "upstream-unavailable", 502)
        assert jobs == {"long": JobState.UNKNOWN, "next": JobState.COMPLETED}
    assert (ledger.count("long"), ledger.count("next")) == (1, 1)


class SlowCompletions(SqliteStore):
    """The real SQLite store, whose completions take `seconds` longer: an answer being stored
    while later requests wait for the upstream."""

    def __init__(self, path: str, seconds: float) -> None:
        super().__init__(path)
        self.seconds = seconds

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        await asyncio.sleep(self.seconds)
        return await super().complete(job, attempt, response, ttl=ttl)


async def test_bytes_sent_after_an_answer_while_it_is_stored_never_answer_the_next_request(
    make_proxy: ProxyFactory, fault_proxy: FaultProxy, ledger: Ledger, tmp_path: Path
) -> None:
    """The upstream connection goes back to the pool once the answer is stored, not once it
    was read: bytes the upstream sends meanwhile (here a whole forged response, 50 ms after
    the answer) land on the finished exchange, and the connection is not reused. Given back
    as soon as its answer was read, a pool of one handed it to the request waiting for it,
    which took the forged bytes as its answer, stored them, and replayed them."""
    path = str(tmp_path / "slow.db")
    store = SlowCompletions(path, seconds=0.3)
    await store.open()
    await store.migrate()
    try:
        client = await make_proxy(
            inject_store=store,
            store=f"sqlite:///{path}",
            upstream=fault_proxy.url,
            pool={"upstream_connections": 1},
        )
        fault_proxy.inject(trail(FORGED, delay=0.05))
        first = asyncio.create_task(post(client, "first"))
        await asyncio.sleep(0.02)  # the first request has the pool's one connection
        second = await post(client, "second")
        assert (await first).status == 201
        assert second.status == 201 and "X-Forged" not in second.headers
        for key in ("first", "second"):
            replay = await post(client, key)
            assert replay.headers[REPLAYED] == "true" and "X-Forged" not in replay.headers
            assert ledger.count(key) == 1
        assert fault_proxy.connections == 2  # the first connection was not reused
    finally:
        await store.close()


async def test_gzip_body_is_relayed_and_stored_byte_for_byte(
    client: Client, fault_proxy: FaultProxy, ledger: Ledger
) -> None:
    first = await post(client, "gz", "/report?gzip=1")
    sent = fault_proxy.exchanges[0].response
    assert sent is not None
    body = await first.read()
    assert first.headers["Content-Encoding"] == "gzip"
    assert sent.endswith(b"\r\n\r\n" + body)  # exactly the backend's bytes, not re-encoded
    assert gzip.decompress(body).startswith(b'{"execution": 1')
    replay = await post(client, "gz", "/report?gzip=1")
    assert (replay.headers[REPLAYED], await replay.read()) == ("true", body)
    assert ledger.count("gz") == 1


async def test_gzip_label_on_bytes_that_are_not_gzip_is_never_decoded(
    client: Client, fault_proxy: FaultProxy, sqlite_jobs: Store
) -> None:
    """Not decompressing is what makes the body byte-identical: a wrong label cannot fail it."""
    garbage = bytes(range(256))
    answer = OK_HEAD + b"Content-Encoding: gzip\r\nContent-Length: 256\r\n\r\n" + garbage
    fault_proxy.inject(replace(answer))
    first = await post(client, "not-gz")
    assert (first.status, await first.read()) == (201, garbage)
    replay = await post(client, "not-gz")
    assert (replay.headers["Content-Encoding"], await replay.read()) == ("gzip", garbage)
    assert (await only_job(sqlite_jobs)).state is JobState.COMPLETED
