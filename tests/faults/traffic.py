"""Traffic and verdicts for the PostgreSQL fault tests.

`send` makes one governed request with a hard deadline (a request that outlives it is a hang,
recorded as such, never waited for); `traffic` runs a bounded loop of concurrent requests over a
small set of keys, so that the same key is in flight on several connections at once. The checks
say what every answer may be while the store fails (SPEC §8, §11), and what the backend and the
database must show afterwards: at most one execution per key, and no execution without a claim
that committed first (SPEC §2.2).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import aiohttp
import asyncpg

from idemproxy.constants import ERROR_HEADER, JOB_HEADER, PROBLEM_CONTENT_TYPE, REPLAYED_HEADER
from tests.support.backend import Ledger

SPREAD = 4  # how many neighbouring keys a turn of the traffic covers
REQUEST_DEADLINE = 10.0  # seconds: an answer later than this is a hang
PATH = "/charges"
# What a proxy may answer while its store fails and recovers (besides the upstream's 201).
ALLOWED_PROBLEMS = {
    (503, "store-unavailable"),
    (409, "request-in-flight"),
    (409, "outcome-unknown"),
}


@dataclass(frozen=True)
class Answer:
    key: str | None
    status: int | None  # None: no answer within REQUEST_DEADLINE
    error: str | None = None  # Idempotency-Error: the proxy's own problem code
    retry_after: str | None = None
    content_type: str | None = None
    replayed: bool = False
    job: str | None = None
    execution: int | None = None  # the backend's execution number in a 201 body
    seconds: float = 0.0

    @property
    def problem(self) -> tuple[int | None, str | None]:
        return self.status, self.error


def body_for(key: str) -> bytes:
    """The same payload every time for a key (a different one would be a mismatch)."""
    return json.dumps({"amount": 100, "for": key}).encode()


async def send(
    session: aiohttp.ClientSession,
    url: str,
    key: str | None,
    *,
    path: str = PATH,
    method: str = "POST",
    deadline: float = REQUEST_DEADLINE,
) -> Answer:
    headers = {"Content-Type": "application/json", "Authorization": "Bearer fault-user"}
    if key is not None:
        headers["Idempotency-Key"] = key
    started = time.monotonic()
    try:
        async with (
            asyncio.timeout(deadline),
            session.request(method, url + path, data=body_for(key or "-"), headers=headers) as r,
        ):
            content = await r.read()
    except TimeoutError:
        return Answer(key, None, seconds=time.monotonic() - started)
    execution = None
    if r.status == 201 and r.content_type == "application/json":
        execution = json.loads(content)["execution"]
    return Answer(
        key,
        r.status,
        r.headers.get(ERROR_HEADER),
        r.headers.get("Retry-After"),
        r.content_type,
        r.headers.get(REPLAYED_HEADER) == "true",
        r.headers.get(JOB_HEADER),
        execution,
        time.monotonic() - started,
    )


async def traffic(
    session: aiohttp.ClientSession,
    url: str,
    prefix: str,
    stop: asyncio.Event,
    *,
    workers: int = 8,
    path: str = PATH,
    pause: float = 0.01,
    max_turns: int = 1000,
) -> list[Answer]:
    """`workers` loops until `stop` is set (or `max_turns` each). At turn t worker w sends key
    `prefix<t + w % SPREAD>`: new keys keep coming, each key is sent by several workers a few
    turns apart and by two workers at once (duplicates in flight)."""

    async def worker(number: int) -> list[Answer]:
        answers = []
        for turn in range(max_turns):
            if stop.is_set():
                break
            key = f"{prefix}{turn + number % SPREAD}"
            answers.append(await send(session, url, key, path=path))
            await asyncio.sleep(pause)
        return answers

    results = await asyncio.gather(*(worker(n) for n in range(workers)))
    return [answer for answers in results for answer in answers]


async def until_executed(
    session: aiohttp.ClientSession, url: str, prefix: str, *, deadline: float = 10.0
) -> Answer:
    """Fresh keys until one executes (the proxy heals by itself); that answer, or the last."""
    until = time.monotonic() + deadline
    for number in itertools.count():
        answer = await send(session, url, f"{prefix}-{number}")
        if answer.status == 201 or time.monotonic() >= until:
            return answer
        await asyncio.sleep(0.05)
    raise AssertionError("unreachable")


async def retry_all(
    session: aiohttp.ClientSession, url: str, keys: Iterable[str], *, path: str = PATH
) -> list[Answer]:
    """Every key once more, all at once: what a client retrying after the incident gets."""
    return list(await asyncio.gather(*(send(session, url, key, path=path) for key in keys)))


def keys_of(answers: Iterable[Answer]) -> set[str]:
    return {answer.key for answer in answers if answer.key is not None}


def unexpected(answers: Iterable[Answer]) -> list[Answer]:
    """Answers that are neither the upstream's 201 nor an allowed problem, and every hang."""
    bad = []
    for answer in answers:
        if answer.status == 201 and answer.error is None:
            continue
        problem = answer.problem in ALLOWED_PROBLEMS and answer.content_type == PROBLEM_CONTENT_TYPE
        if problem and (answer.status != 503 or answer.retry_after is not None):
            continue  # SPEC §8: a 503 always says when to retry
        bad.append(answer)
    return bad


def inconsistent(answers: Iterable[Answer]) -> dict[str, set[tuple[str | None, int | None]]]:
    """Keys whose 201 answers disagree: a replay must be the original (job, execution)."""
    seen: dict[str, set[tuple[str | None, int | None]]] = defaultdict(set)
    for answer in answers:
        if answer.status == 201 and answer.key is not None:
            seen[answer.key].add((answer.job, answer.execution))
    return {key: outcomes for key, outcomes in seen.items() if len(outcomes) > 1}


def executed_twice(ledger: Ledger, keys: Iterable[str]) -> dict[str, int]:
    counts = {key: ledger.count(key) for key in keys}
    return {key: count for key, count in counts.items() if count > 1}


async def jobs_by_id(dsn: str) -> dict[str, asyncpg.Record]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch(
            "SELECT id::text AS id, key, state, version, attempt_count FROM idemproxy.jobs",
            timeout=10,
        )
    finally:
        await conn.close(timeout=10)
    return {row["id"]: row for row in rows}


async def unclaimed_executions(ledger: Ledger, dsn: str) -> list[tuple[str | None, str | None]]:
    """Executions the backend saw whose job (Idempotency-Job) was not committed for that key:
    a forward without a claim. SPEC §2.2: the claim commits before a byte goes upstream."""
    jobs = await jobs_by_id(dsn)
    missing: list[tuple[str | None, str | None]] = []
    for execution in ledger.executions:
        key = execution.header("Idempotency-Key")
        job = execution.header(JOB_HEADER)
        if key is not None and (job not in jobs or jobs[job]["key"] != key):
            missing.append((key, job))
    return missing


async def settled_connections(
    count: Callable[[], Awaitable[int]], limit: int, *, deadline: float = 5.0
) -> int:
    """Poll `count()` until it is at most `limit` or the deadline passes; the last value.
    Terminated or aborted sessions take a moment to leave pg_stat_activity."""
    until = time.monotonic() + deadline
    while True:
        current: int = await count()
        if current <= limit or time.monotonic() >= until:
            return current
        await asyncio.sleep(0.1)


def summary(answers: Sequence[Answer]) -> dict[str, int]:
    """How many answers of each kind, for assertion messages and sanity checks."""
    kinds: dict[str, int] = defaultdict(int)
    for answer in answers:
        if answer.status == 201:
            kinds["replayed" if answer.replayed else "executed"] += 1
        else:
            kinds[f"{answer.status} {answer.error}"] += 1
    return dict(kinds)


async def assert_one_job_per_intent(answers: Sequence[Answer], ledger: Ledger, dsn: str) -> None:
    """The verdict after an incident: allowed answers only and no hang, replays that agree with
    the original, at most one execution per key, none without a committed claim."""
    bad = unexpected(answers)
    assert not bad, (summary(answers), bad[:10])
    assert not inconsistent(answers), inconsistent(answers)
    twice = executed_twice(ledger, keys_of(answers))
    assert not twice, twice
    unclaimed = await unclaimed_executions(ledger, dsn)
    assert not unclaimed, unclaimed


def after_the_lease(retries: Sequence[Answer]) -> list[Answer]:
    """Retries sent once every lease ran out may only be executed, replayed or outcome-unknown
    (a job whose completion was lost was taken over): never held, never a store error."""
    return [
        answer
        for answer in retries
        if not (answer.status == 201 or answer.problem == (409, "outcome-unknown"))
    ]
