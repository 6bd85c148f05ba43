"""The admin API refuses bad filters with 400 before the store sees them, and a resolution
cannot store headers that the proxy itself would never accept (SPEC §3.3, §13), on both stores.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from idemproxy.constants import MAX_RESOLVED_HEADER_BYTES
from idemproxy.core.types import JobState
from idemproxy.errors import InvalidRequest
from idemproxy.ops.resolution import ResponseRules, completed
from idemproxy.store.base import Store

from .conftest import Upstream
from .test_jobs_api import assert_problem, make_unknown, resolve

Client = TestClient[Any, Any]
RULES = ResponseRules(unreplayed_headers=["set-cookie"], max_body=1024)


@pytest.mark.parametrize(
    "query",
    [
        "owner=a%00b",  # a NUL: PostgreSQL refused it, a 503 counted as a store error
        "owner=caf%C3%A9",
        "owner=" + "a" * 256,
        "owner=two%20words",
        "state=unknown%00",
        "states=unknown",  # misspelt: would have listed every job
        "limit=0",
        "limit=1001",
        "limit=%EF%BC%91",  # a fullwidth digit
        "state=unknown&state=released",
    ],
)
async def test_bad_list_filters_are_400_and_never_reach_the_store(
    admin: Client, store: Store, query: str
) -> None:
    failed: list[str] = []
    store.observer = lambda operation, _seconds, bad: failed.append(operation) if bad else None
    async with admin.get(f"/jobs?{query}") as response:
        await assert_problem(response, 400, "invalid-request")
    assert failed == []


async def test_good_filters_still_list(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    async with admin.get(f"/jobs?state=unknown&owner={job.owner}&limit=5") as response:
        assert response.status == 200
        assert [j["id"] for j in await response.json()] == [job.id]
    async with admin.get(f"/jobs/{job.id}?include=all") as response:
        await assert_problem(response, 400, "invalid-request")


async def test_a_resolution_with_a_header_no_client_could_take_is_refused(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    for headers in (
        [["X-Big", "x" * 20_000]],  # 20 KB: over server.max_field_size
        [[f"X-{i}", "v"] for i in range(129)],  # over server.max_headers
        [["X-Pad", " leading"]],
    ):
        body = {"as": "completed", "status": 200, "headers": headers, "body": "{}"}
        async with await resolve(admin, job.id, body) as response:
            await assert_problem(response, 400, "invalid-request")
    after = await store.get_by_id(job.id)
    assert after is not None and after.state is JobState.UNKNOWN
    fits = {"as": "completed", "status": 200, "headers": [["X-Big", "x" * 8000]], "body": "{}"}
    async with await resolve(admin, job.id, fits) as response:
        assert response.status == 200, await response.text()


def test_header_limits_are_the_proxys_own() -> None:
    at_limit = [("X-A", "v" * (8190 - len("X-A: ")))]
    assert completed(200, at_limit, b"", RULES).response is not None
    with pytest.raises(InvalidRequest, match="max_field_size"):
        completed(200, [("X-A", "v" * (8191 - len("X-A: ")))], b"", RULES)
    assert completed(200, [("X-A", "1")] * 128, b"", RULES).response is not None
    with pytest.raises(InvalidRequest, match="max_headers"):
        completed(200, [("X-A", "1")] * 129, b"", RULES)
    # Within the count and field size, but over the total (8 fields of 8 KiB ≈ 64 KiB).
    wide = [(f"X-{i}", "v" * 8180) for i in range(MAX_RESOLVED_HEADER_BYTES // 8180 + 1)]
    with pytest.raises(InvalidRequest, match="in all"):
        completed(200, wide, b"", RULES)
    smaller = ResponseRules(unreplayed_headers=[], max_body=10, max_headers=2, max_field_size=20)
    with pytest.raises(InvalidRequest, match="max_headers"):
        completed(200, [("A", "1")] * 3, b"", smaller)
    for value in (" x", "x ", "\tx"):
        with pytest.raises(InvalidRequest, match="leading or trailing"):
            completed(200, [("X-A", value)], b"", RULES)
