"""Connection integrity: on one keep-alive connection, response i answers request i (SPEC §7).

Every request carries a unique `X-Marker` that the upstream (tests/support/marker_upstream.py)
echoes in a header and at the start of its body; the client reads the connection's raw bytes and
parses each response strictly by its own framing (tests/support/rawhttp.py). A second status line
in the middle of a body, or an answer written after the previous one ended, shows up as a body
that is not the upstream's, a response whose marker belongs to another request, or bytes
nobody asked for. Behind a load balancer that pools connections, the next request on a
connection may be another tenant's: these are the tests that keep it from reading this one's
answer.

Each fault the suite injects elsewhere is applied here to one request among several on the same
connection: hedging with a streamed winner, fail-over, the store failing after the head went
out, the upstream cutting its body, the upstream resetting. A fault that leaves no honest way
to go on (a body cut off mid-way) must end the connection, with no byte after it.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from idemproxy.core.types import JobState
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.jobs import jobrun
from idemproxy.store.base import Store
from idemproxy.store.factory import sqlite_path
from tests.support.marker_upstream import MarkerUpstream, Play, answer, body_for, cut, reset
from tests.support.proxychecks import REPLAYED, only_job, wait_for_state
from tests.support.rawhttp import RawConnection, RawResponse

from .conftest import ListeningProxy

StartUpstream = Callable[[str, dict[str, Play]], Awaitable[MarkerUpstream]]
# SPEC §7: a body over max_stored_body streams through; these bodies are all over it.
MAX_STORED = 100
LARGE = 20_000


@pytest.fixture
async def upstreams() -> AsyncIterator[StartUpstream]:
    started: list[MarkerUpstream] = []

    async def start(name: str, plays: dict[str, Play]) -> MarkerUpstream:
        upstream = await MarkerUpstream(name, plays).start()
        started.append(upstream)
        return upstream

    try:
        yield start
    finally:
        for upstream in started:
            await upstream.close()


async def connect(listening_proxy: ListeningProxy, **overrides: Any) -> RawConnection:
    host, port = await listening_proxy(**overrides)
    return await RawConnection.open(host, port)


def assert_answers(response: RawResponse, marker: str, upstream: str, size: int = 40) -> None:
    """The upstream's own answer to the request carrying `marker`, whole and unaltered."""
    assert response.marker == marker, (response.status, response.headers, response.body[:200])
    assert response.headers["X-Upstream"] == upstream
    assert response.whole
    assert response.body == body_for(marker, upstream, size), response.body[:200]


async def arrived(upstream: MarkerUpstream, marker: str) -> None:
    for _ in range(200):
        if upstream.count(marker):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{marker} never reached {upstream.name}")


@contextmanager
def store_locked(dsn: str) -> Iterator[None]:
    """Another connection holds SQLite's write lock: every write of the proxy's times out."""
    other = sqlite3.connect(sqlite_path(dsn), isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
        other.execute("ROLLBACK")
    finally:
        other.close()


async def test_a_hedged_streamed_winner_is_the_only_answer_on_its_connection(
    listening_proxy: ListeningProxy, upstreams: StartUpstream
) -> None:
    """Issue 17, 1(a): the primary's body is over max_stored_body and streams slowly; the
    fallback, hedged after 0.2 s, answers at 0.8 s while the primary streams, and loses the
    completion CAS. The client gets the primary's 20 KB and nothing else, and the next request
    its own answer."""
    primary = await upstreams(
        "primary", {"/pay": answer(size=LARGE, delay=0.4, chunk=2000, pace=0.1)}
    )
    fallback = await upstreams("fallback", {"/pay": answer(delay=0.6)})
    conn = await connect(
        listening_proxy,
        upstream=primary.url,
        fallbacks=[fallback.url],
        hedge_after=0.2,
        max_stored_body=MAX_STORED,
    )
    conn.send("POST", "/pay", marker="m1", key="hedged-large", body=b"pay")
    assert_answers(await conn.response(), "m1", "primary", LARGE)
    assert fallback.count("m1") == 1, "the hedge did not start: the test proves nothing"
    conn.send("POST", "/next", marker="m2", key="after-hedge", body=b"pay")
    assert_answers(await conn.response(), "m2", "primary")
    assert await conn.quiet() == b""
    conn.close()


async def test_a_store_failing_after_the_head_never_adds_a_second_answer(
    listening_proxy: ListeningProxy,
    upstreams: StartUpstream,
    sqlite_dsn: str,
    sqlite_jobs: Store,
) -> None:
    """Issue 17, 1(b): the head of a streamed 200 is out when the store stops taking writes.
    The 200 is finished, no 503 follows it, the next request gets its own answer, and the
    outcome is written once the store answers again (proxy/background/unwritten.py)."""
    primary = await upstreams("primary", {"/pay": answer(size=LARGE, chunk=2000, pace=0.08)})
    conn = await connect(
        listening_proxy,
        upstream=primary.url,
        max_stored_body=MAX_STORED,
        pool={"store_timeout": 0.5},
    )
    conn.send("POST", "/pay", marker="m1", key="locked-store", body=b"pay")
    await arrived(primary, "m1")  # claimed and forwarded: the next write is the completion
    with store_locked(sqlite_dsn):
        assert_answers(await conn.response(), "m1", "primary", LARGE)
        # Not governed: no store call, so it is answered while the store is still locked.
        conn.send("GET", "/read", marker="m2")
        assert_answers(await conn.response(method="GET"), "m2", "primary")
        assert await conn.quiet(0.8) == b""
    job = await only_job(sqlite_jobs)
    await wait_for_state(sqlite_jobs, job.id, JobState.COMPLETED, timeout=5.0)
    conn.send("POST", "/pay", marker="m3", key="locked-store", body=b"pay")
    replay = await conn.response()
    assert (replay.status, replay.marker, replay.headers[REPLAYED]) == (200, "m1", "true")
    assert primary.count("m1") == 1 and primary.count("m3") == 0
    assert await conn.quiet() == b""
    conn.close()


async def test_the_backstop_closes_the_connection_instead_of_writing_a_second_response(
    listening_proxy: ListeningProxy,
    upstreams: StartUpstream,
    sqlite_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 17, 1: with the fix of 1(b) undone (a store error after the head goes on to the
    handler, which returns a 503), the handler's check still never writes that 503: the 200
    that started is the connection's last response."""

    async def unguarded(_attempt: object, storing: Awaitable[object]) -> None:
        await storing

    monkeypatch.setattr(jobrun, "_after_head", unguarded)
    primary = await upstreams("primary", {"/pay": answer(size=LARGE, chunk=2000, pace=0.08)})
    metrics = Metrics()
    conn = await connect(
        listening_proxy,
        metrics=metrics,
        upstream=primary.url,
        max_stored_body=MAX_STORED,
        pool={"store_timeout": 0.5},
    )
    conn.send("POST", "/pay", marker="m1", key="backstop", body=b"pay")
    await arrived(primary, "m1")
    with store_locked(sqlite_dsn):
        assert_answers(await conn.response(), "m1", "primary", LARGE)
        conn.send("GET", "/read", marker="m2")  # queued behind the first: never answered
        assert await conn.closed()
    assert "connection closed instead" in caplog.text
    assert metrics.registry.get_sample_value("idemproxy_second_responses_refused_total") == 1
    assert primary.count("m2") == 0
    conn.close()


@dataclass(frozen=True)
class Fault:
    """One faulted request among others on a connection, and what its client must see."""

    primary: Play
    fallback: Play | None = None
    settings: dict[str, object] = field(default_factory=dict)
    governed: bool = True
    answered_by: str | None = None  # the upstream whose whole answer arrives
    size: int = 40
    problem: int | None = None  # or the proxy's own problem with this status
    # Otherwise: the body is cut off, and the connection ends after it.


HEDGED: dict[str, object] = {"hedge_after": 0.1}
FAULTS = {
    "hedged, the fallback wins": Fault(answer(delay=0.5), answer(), HEDGED, answered_by="fallback"),
    "hedged, a streamed primary wins": Fault(
        answer(size=LARGE, delay=0.2, chunk=4000, pace=0.1),
        answer(delay=0.3),
        {**HEDGED, "max_stored_body": MAX_STORED},
        answered_by="primary",
        size=LARGE,
    ),
    "hedged, chunked": Fault(
        answer(size=LARGE, delay=0.5, chunked=True, chunk=5000),
        answer(size=LARGE, chunked=True, chunk=5000),
        {**HEDGED, "max_stored_body": MAX_STORED},
        answered_by="fallback",
        size=LARGE,
    ),
    "fail-over after a release": Fault(answer(503), answer(), answered_by="fallback"),
    "upstream cut before max_stored_body": Fault(cut(50), problem=502),
    "upstream cut mid-stream": Fault(cut(5000), settings={"max_stored_body": MAX_STORED}),
    "upstream reset": Fault(reset(), problem=502),
    "pass-through, upstream cut mid-stream": Fault(cut(5000, declared=200_000), governed=False),
    "pass-through, upstream reset": Fault(reset(), governed=False, problem=502),
}


async def fault_connection(
    listening_proxy: ListeningProxy, upstreams: StartUpstream, fault: Fault
) -> tuple[RawConnection, MarkerUpstream]:
    primary = await upstreams("primary", {"/fault": fault.primary})
    overrides: dict[str, object] = {"upstream": primary.url, **fault.settings}
    if fault.fallback is not None:
        fallback = await upstreams("fallback", {"/fault": fault.fallback})
        overrides["fallbacks"] = [fallback.url]
    return await connect(listening_proxy, **overrides), primary


def send(conn: RawConnection, path: str, marker: str, *, governed: bool) -> str:
    if governed:
        conn.send("POST", path, marker=marker, key=f"key-{marker}", body=b"pay")
        return "POST"
    conn.send("GET", path, marker=marker)
    return "GET"


def assert_faulted(response: RawResponse, fault: Fault, marker: str) -> None:
    if fault.answered_by is not None:
        assert_answers(response, marker, fault.answered_by, fault.size)
    elif fault.problem is not None:
        assert response.status == fault.problem, (response.status, response.body[:200])
        assert "Idempotency-Error" in response.headers and response.whole
        assert response.marker is None
    else:  # what arrived of the upstream's answer, and no more
        assert (response.status, response.marker, response.whole) == (200, marker, False)
        assert body_for(marker, "primary", LARGE).startswith(response.body)


@pytest.mark.parametrize("pipelined", [False, True], ids=["in-turn", "pipelined"])
@pytest.mark.parametrize("name", list(FAULTS))
async def test_each_response_answers_its_own_request_under_a_fault(
    listening_proxy: ListeningProxy,
    upstreams: StartUpstream,
    caplog: pytest.LogCaptureFixture,
    name: str,
    pipelined: bool,
) -> None:
    """Three requests on one connection, the middle one faulted: the first and the last get
    their own upstream answer, the middle one what its fault allows, and nothing else arrives.
    Pipelined, all three are sent before the first answer is read (RFC 9112 §9.3.2). None of
    these faults is the proxy's bug: nothing is logged at ERROR (no traceback per fault)."""
    fault = FAULTS[name]
    conn, primary = await fault_connection(listening_proxy, upstreams, fault)
    tag = f"{list(FAULTS).index(name)}{'p' if pipelined else 't'}"
    markers = [f"m{tag}-{i}" for i in range(3)]
    paths = ["/before", "/fault", "/after"]
    governed = fault.governed
    pairs = zip(paths, markers, strict=True)
    methods = [send(conn, p, m, governed=governed) for p, m in pairs] if pipelined else []
    for index, marker in enumerate(markers):
        if not pipelined:
            methods.append(send(conn, paths[index], marker, governed=governed))
        response = await conn.response(method=methods[index])
        if index != 1:
            assert_answers(response, marker, "primary")
            continue
        assert_faulted(response, fault, marker)
        if fault.answered_by is None and fault.problem is None:
            assert await conn.closed()  # a cut body: the connection ends right after it
            assert primary.count(markers[2]) == 0
            break
    else:
        assert await conn.quiet() == b""
    conn.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def completed(jobs: Store) -> None:
    for _ in range(300):
        listed = await jobs.list_jobs()
        if listed and listed[0].state is JobState.COMPLETED:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the job never completed")


RACES = {
    # The fallback answers while the primary streams: its completion CAS cannot reach the store.
    "the losing racer's completion": (
        answer(size=LARGE, delay=0.4, chunk=2000, pace=0.15),
        answer(delay=0.5),
    ),
    # The primary streams from the start: the hedge due at 0.2 s cannot be added.
    "the next hedge": (answer(size=LARGE, chunk=2000, pace=0.15), answer()),
}


@pytest.mark.parametrize("failing", list(RACES))
async def test_a_store_failing_during_a_race_never_interrupts_the_streaming_winner(
    listening_proxy: ListeningProxy,
    upstreams: StartUpstream,
    sqlite_dsn: str,
    sqlite_jobs: Store,
    failing: str,
) -> None:
    """The primary won the race and streams its answer; then a store call of the race fails.
    That error belongs to no response: before, it went on to the handler, and a 503 was
    written into the middle of the primary's body."""
    primary_play, fallback_play = RACES[failing]
    primary = await upstreams("primary", {"/pay": primary_play})
    fallback = await upstreams("fallback", {"/pay": fallback_play})
    conn = await connect(
        listening_proxy,
        upstream=primary.url,
        fallbacks=[fallback.url],
        hedge_after=0.2,
        max_stored_body=MAX_STORED,
        pool={"store_timeout": 0.5},
    )
    conn.send("POST", "/pay", marker="m1", key="race", body=b"pay")
    await completed(sqlite_jobs)  # the primary won the CAS and is streaming
    with store_locked(sqlite_dsn):
        assert_answers(await conn.response(), "m1", "primary", LARGE)
        conn.send("GET", "/read", marker="m2")
        assert_answers(await conn.response(method="GET"), "m2", "primary")
        assert await conn.quiet() == b""
    assert primary.count("m1") == 1
    conn.close()


AFTER_THE_HEAD = {
    # SPEC §3.2: a body cut off may have executed: unknown, and the client's connection ends.
    "the upstream cuts the body": (cut(5000, wait=0.8), JobState.UNKNOWN),
    # A 502 is unknown too, and its body is over max_stored_body: it streams, then settles.
    "an unknown status streams": (answer(502, size=LARGE, chunk=2000, pace=0.08), JobState.UNKNOWN),
}


@pytest.mark.parametrize("case", list(AFTER_THE_HEAD))
async def test_a_settlement_the_store_cannot_take_after_the_head_adds_no_answer(
    listening_proxy: ListeningProxy,
    upstreams: StartUpstream,
    sqlite_dsn: str,
    sqlite_jobs: Store,
    case: str,
) -> None:
    """As for the completion (1(b)), for the settlements written after a streamed head: the
    client gets what the upstream sent (cut off: then the connection closes), never a 503 after
    it, and the job is settled once the store answers."""
    play, settled = AFTER_THE_HEAD[case]
    primary = await upstreams("primary", {"/pay": play})
    conn = await connect(
        listening_proxy,
        upstream=primary.url,
        max_stored_body=MAX_STORED,
        pool={"store_timeout": 0.5},
    )
    conn.send("POST", "/pay", marker="m1", key="settled", body=b"pay")
    await arrived(primary, "m1")
    with store_locked(sqlite_dsn):
        response = await conn.response(timeout=3.0)
        assert response.marker == "m1"
        if response.whole:
            assert_answers(response, "m1", "primary", LARGE)
            conn.send("GET", "/read", marker="m2")
            assert_answers(await conn.response(method="GET"), "m2", "primary")
            assert await conn.quiet(0.8) == b""
        else:
            assert body_for("m1", "primary", LARGE).startswith(response.body)
            assert await conn.closed()
    job = await only_job(sqlite_jobs)
    await wait_for_state(sqlite_jobs, job.id, settled, timeout=5.0)
    conn.close()


async def test_a_pipelined_duplicate_of_a_streamed_job_gets_its_replay_after_it(
    listening_proxy: ListeningProxy, upstreams: StartUpstream
) -> None:
    """The duplicate is queued behind the original on the same connection: it is answered
    after the original's last byte, with the replay (body omitted, SPEC §7), never inside it."""
    primary = await upstreams("primary", {"/pay": answer(size=LARGE, chunk=2000, pace=0.03)})
    conn = await connect(listening_proxy, upstream=primary.url, max_stored_body=MAX_STORED)
    conn.send("POST", "/pay", marker="m1", key="dup", body=b"pay")
    conn.send("POST", "/pay", marker="m2", key="dup", body=b"pay")
    conn.send("POST", "/next", marker="m3", key="other", body=b"pay")
    assert_answers(await conn.response(), "m1", "primary", LARGE)
    replay = await conn.response()
    assert (replay.status, replay.marker, replay.body) == (200, "m1", b"")
    assert (replay.headers[REPLAYED], replay.headers["Idempotency-Replay"]) == ("true", "omitted")
    assert_answers(await conn.response(), "m3", "primary")
    assert await conn.quiet() == b""
    assert primary.received == ["m1", "m3"]
    conn.close()
