"""Small helpers shared by the proxy integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient

from idemproxy.core.types import Job, JobState
from idemproxy.store.ports import Operators
from tests.support.ports import free_port

KEY = "Idempotency-Key"
JOB = "Idempotency-Job"
ATTEMPT = "Idempotency-Attempt"
REPLAYED = "Idempotent-Replayed"


_RETRY_ADVICE = frozenset({"same-key", "new-key-safe", "never"})
_JOB_STATES = frozenset({"none", "in_flight", "completed", "released", "unknown"})


async def assert_problem(
    response: aiohttp.ClientResponse,
    code: str,
    status: int,
    *,
    retry: str | None = None,
    job_state: str | None = None,
) -> dict[str, Any]:
    """SPEC §8: an RFC 9457 problem with our type URN and the Idempotency-Error header, saying
    where the client stands (`job_state`, `retry`, and `instance` naming its job if it has one)."""
    body = await response.read()
    assert response.status == status, (response.status, body[:300])
    assert response.headers["Content-Type"].startswith("application/problem+json")
    assert response.headers["Idempotency-Error"] == code
    problem: dict[str, Any] = json.loads(body)
    assert problem["type"] == f"urn:idemproxy:problem:{code}"
    assert problem["code"] == code
    assert problem["status"] == status
    assert problem["title"]
    assert problem["detail"]
    assert REPLAYED not in response.headers
    assert problem["retry"] in _RETRY_ADVICE, problem
    assert problem["job_state"] in _JOB_STATES, problem
    if problem["job_state"] == "none":
        assert "instance" not in problem, problem
    else:
        assert re.fullmatch(r"urn:idemproxy:job:[0-9a-f-]{36}", problem["instance"]), problem
    if problem["job_state"] == "unknown":
        assert problem["retry"] == "never", problem
    if retry is not None:
        assert problem["retry"] == retry, problem
    if job_state is not None:
        assert problem["job_state"] == job_state, problem
    return problem


async def only_job(jobs: Operators) -> Job:
    """The one job in the store, with its attempts."""
    listed = await jobs.list_jobs()
    assert len(listed) == 1, listed
    job = await jobs.get_by_id(listed[0].id)
    assert job is not None
    return job


async def wait_for_state(
    jobs: Operators, job_id: str, state: JobState, timeout: float = 3.0
) -> Job:
    """Poll until the job reaches `state` (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        job = await jobs.get_by_id(job_id)
        if job is not None and job.state is state:
            return job
        assert time.monotonic() < deadline, f"job {job_id} stayed {job and job.state}"
        await asyncio.sleep(0.02)


async def eventually(check: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def job_with_attempts(store: Operators, key: str, owner: str = "anonymous") -> Job:
    """The job under (owner, key), read by id so that its attempts come with it."""
    job = await store.get(owner, key)
    assert job is not None
    full = await store.get_by_id(job.id)
    assert full is not None
    return full


async def settle_quietly(seconds: float = 0.05) -> None:
    """Give anything that should NOT happen a moment to happen."""
    await asyncio.sleep(seconds)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connection refused), and that no server of
    a test is given later: one of the tests' own ports (tests/support/ports.py), claimed for
    this process and never bound. A port the kernel chose and let go may be handed to another
    worker's server before the connection is tried."""
    return free_port()


@contextlib.contextmanager
def refusing(port: int) -> Iterator[None]:
    """`port` of 127.0.0.1, whose server just closed, held bound without listening while the
    block runs: a connection to it is refused, and no server of another test (the kernel hands
    its ephemeral ports out again) can be given it meanwhile and answer instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past its TIME_WAITs
        sock.bind(("127.0.0.1", port))
        yield


def http_date_age(value: str) -> float:
    """Seconds between an HTTP-date and now."""
    return abs(time.time() - parsedate_to_datetime(value).timestamp())


async def raw_exchange(
    client: TestClient[Any, Any], request: bytes
) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send exact request bytes (ending `Connection: close`) to the proxy; parse the answer."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout=5)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = [(n.strip(), v.strip()) for n, _, v in (line.partition(":") for line in lines[1:])]
    return status, headers, body


async def wait_for_jobs(jobs: Operators, count: int = 1, timeout: float = 3.0) -> list[Job]:
    """Poll until the store holds `count` jobs (e.g. a request in flight has claimed its key)."""
    deadline = time.monotonic() + timeout
    while len(listed := await jobs.list_jobs()) < count:
        assert time.monotonic() < deadline, f"{len(listed)} jobs, expected {count}"
        await asyncio.sleep(0.01)
    return listed
