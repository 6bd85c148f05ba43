"""The admin jobs API (SPEC §3.3, §13) on both stores, next to a proxy sharing the store."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from idemproxy.core.types import Evidence, Intent, Job, JobState
from idemproxy.store.base import Store

from .conftest import ALICE, BOB, TOKEN, MakeClient, MakeSettings, Upstream, post

Client = TestClient[Any, Any]
JOB_FIELDS = {"id", "owner", "key", "state", "version", "created_at", "expires_at", "attempts"}
ATTEMPT_FIELDS = {"number", "upstream", "state", "status", "error", "started_at", "finished_at"}


async def job_with_key(store: Store, key: str) -> Job:
    """The job a request with `key` made, with its attempts."""
    matching = [job for job in await store.list_jobs() if job.key == key]
    assert len(matching) == 1, matching
    job = await store.get_by_id(matching[0].id)
    assert job is not None
    return job


async def make_unknown(
    proxy: Client, upstream: Upstream, store: Store, key: str, owner: dict[str, str] = ALICE
) -> Job:
    """SPEC §3.2: a 504 from the upstream may have executed downstream, so the job is unknown."""
    upstream.script.append(504)
    status, _headers, _body = await post(proxy, key, owner=owner)
    assert status == 504
    job = await job_with_key(store, key)
    assert job.state is JobState.UNKNOWN
    return job


async def make_completed(proxy: Client, store: Store, key: str) -> Job:
    status, _headers, _body = await post(proxy, key)
    assert status == 201
    job = await job_with_key(store, key)
    assert job.state is JobState.COMPLETED
    return job


async def assert_problem(response: Any, status: int, code: str) -> dict[str, Any]:
    body = await response.read()
    assert response.status == status, body
    assert response.headers["Content-Type"].startswith("application/problem+json")
    problem: dict[str, Any] = json.loads(body)
    assert (problem["status"], problem["code"]) == (status, code)
    assert problem["type"] == f"urn:idemproxy:problem:{code}"
    assert problem["title"]
    assert problem["detail"]
    return problem


async def get_json(admin: Client, path: str) -> Any:
    async with admin.get(path) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def resolve(admin: Client, job_id: str, body: dict[str, Any]) -> Any:
    return await admin.post(f"/jobs/{job_id}/resolve", json=body)


COMPLETED: dict[str, Any] = {
    "as": "completed",
    "status": 201,
    "headers": [["Content-Type", "application/json"], ["Location", "/charges/42"]],
    "body": '{"charge": 42, "resolved": true}',
}


# --- list and show ------------------------------------------------------------------------------


async def test_list_filters_by_state_owner_and_limit(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    done = await make_completed(proxy, store, "k-done")
    lost = await make_unknown(proxy, upstream, store, "k-lost")
    bobs = await make_unknown(proxy, upstream, store, "k-bob", owner=BOB)

    listed = await get_json(admin, "/jobs")
    assert {job["id"] for job in listed} == {done.id, lost.id, bobs.id}
    for job in listed:
        assert set(job) >= JOB_FIELDS
        assert len(job["attempts"]) == 1  # SPEC §13: listed jobs carry their attempts too
        assert set(job["attempts"][0]) >= ATTEMPT_FIELDS
    unknown = await get_json(admin, "/jobs?state=unknown")
    assert {job["id"] for job in unknown} == {lost.id, bobs.id}
    alices = await get_json(admin, f"/jobs?state=unknown&owner={lost.owner}")
    assert [job["id"] for job in alices] == [lost.id]
    assert len(await get_json(admin, "/jobs?limit=1")) == 1
    nobodys = "0" * 64  # an owner hash no job has
    assert await get_json(admin, f"/jobs?owner={nobodys}") == []
    async with admin.get("/jobs?owner=nobody") as response:  # no owner is named so
        await assert_problem(response, 400, "invalid-request")


@pytest.mark.parametrize("query", ["state=lost", "limit=0", "limit=x", "limit=1001", "limit=²"])
async def test_list_rejects_bad_parameters(admin: Client, query: str) -> None:
    async with admin.get(f"/jobs?{query}") as response:
        await assert_problem(response, 400, "invalid-request")


async def test_find_a_job_by_the_clients_key_in_one_owners_scope(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    """Support is asked "what happened to order-1234?": the key and whose it is."""
    lost = await make_unknown(proxy, upstream, store, "order-1234")
    upstream.script.append(504)
    assert (await post(proxy, "order-1234", owner=BOB))[0] == 504
    [bobs] = [job for job in await store.list_jobs() if job.id != lost.id]
    assert bobs.key == "order-1234" and bobs.owner != lost.owner
    for who in ({"credential": ALICE["Authorization"]}, {"owner": lost.owner}):
        async with admin.post("/jobs/find", json={"key": "order-1234", **who}) as response:
            assert response.status == 200, await response.text()
            found = await response.json()
        assert (found["id"], found["state"], found["owner"]) == (lost.id, "unknown", lost.owner)
        assert len(found["attempts"]) == 1 and "response" not in found
    async with admin.post(
        "/jobs/find", json={"key": "order-1234", "credential": BOB["Authorization"]}
    ) as response:
        assert (await response.json())["id"] == bobs.id
    # Another owner's key is not found, whoever asks: never a search across owners.
    async with admin.post(
        "/jobs/find", json={"key": "order-1234", "credential": "Bearer mallory"}
    ) as response:
        await assert_problem(response, 404, "job-not-found")
    async with admin.post("/jobs/find", json={"key": "order-1234", "sender": "stripe"}) as response:
        await assert_problem(response, 404, "job-not-found")


@pytest.mark.parametrize(
    "body",
    [
        {"key": "k"},
        {"key": "k", "owner": "o", "sender": "s"},
        {"key": "", "owner": "o"},
        {"key": "k\u0000", "owner": "o"},
        {"key": 7, "owner": "o"},
        {"key": "k", "owner": "o", "extra": 1},
        {"key": "k", "credential": ""},
    ],
)
async def test_find_refuses_what_names_no_single_key_and_owner(
    admin: Client, body: dict[str, Any]
) -> None:
    async with admin.post("/jobs/find", json=body) as response:
        await assert_problem(response, 400, "invalid-request")


async def test_show_has_the_attempts_and_never_the_body_by_default(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    shown = await get_json(admin, f"/jobs/{job.id}")
    assert set(shown) >= JOB_FIELDS | {"resolution", "completed_by", "updated_at"}
    assert (shown["id"], shown["key"], shown["owner"]) == (job.id, "k-1", job.owner)
    assert (shown["state"], shown["version"]) == ("unknown", job.version)
    assert (shown["method"], shown["path"]) == ("POST", "/charges")
    assert shown["resolution"] is None
    assert shown["response_status"] is None
    [attempt] = shown["attempts"]
    assert attempt["number"] == 1
    assert (attempt["upstream"], attempt["state"], attempt["status"]) == (
        upstream.url,
        "unknown",
        504,
    )
    assert attempt["started_at"] <= attempt["finished_at"]
    assert shown["created_at"] < shown["expires_at"]


async def test_a_stored_body_is_shown_only_when_asked_for(
    admin: Client, proxy: Client, store: Store
) -> None:
    job = await make_completed(proxy, store, "k-1")
    async with admin.get(f"/jobs/{job.id}") as response:
        text = await response.text()
    shown = json.loads(text)
    assert shown["response_status"] == 201
    assert "response" not in shown
    assert "execution" not in text  # the upstream's body, which may hold a tenant's data
    full = await get_json(admin, f"/jobs/{job.id}?include=response")
    assert full["response"]["status"] == 201
    assert json.loads(full["response"]["body"])["execution"] == 1
    assert ["Location", "/things/1"] in full["response"]["headers"]


@pytest.mark.parametrize(
    "job_id", [str(uuid.uuid4()), "not-a-uuid"], ids=["no-such-job", "not-a-uuid"]
)
async def test_show_a_missing_job_is_404(admin: Client, job_id: str) -> None:
    async with admin.get(f"/jobs/{job_id}") as response:
        await assert_problem(response, 404, "job-not-found")


# --- resolve ------------------------------------------------------------------------------------


async def test_resolved_as_completed_the_proxy_replays_it(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    status, _headers, _body = await post(proxy, "k-1")
    assert status == 409  # SPEC §2.3: outcome-unknown until resolved

    async with await resolve(admin, job.id, COMPLETED) as response:
        assert response.status == 200, await response.text()
        resolved = await response.json()
    assert (resolved["state"], resolved["version"]) == ("completed", job.version + 1)
    assert (resolved["resolution"], resolved["completed_by"]) == ("operator", 0)
    assert resolved["response_status"] == 201
    assert "response" not in resolved

    status, headers, body = await post(proxy, "k-1")
    assert (status, body) == (201, COMPLETED["body"].encode())
    assert headers["Idempotent-Replayed"] == "true"
    assert headers["Content-Type"] == "application/json"
    assert headers["Location"] == "/charges/42"
    assert upstream.executions == 1  # never executed again


async def test_resolved_with_a_binary_body(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    payload = bytes(range(256)) * 3
    body = {"as": "completed", "status": 200, "body_base64": base64.b64encode(payload).decode()}
    async with await resolve(admin, job.id, body) as response:
        assert response.status == 200, await response.text()
    status, headers, replayed = await post(proxy, "k-1")
    assert (status, replayed, headers["Idempotent-Replayed"]) == (200, payload, "true")
    shown = await get_json(admin, f"/jobs/{job.id}?include=response")
    assert base64.b64decode(shown["response"]["body_base64"]) == payload


async def test_resolved_as_released_a_retry_executes_again(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    async with await resolve(admin, job.id, {"as": "released"}) as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["state"] == "released"

    status, headers, body = await post(proxy, "k-1")
    assert status == 201
    assert "Idempotent-Replayed" not in headers
    assert json.loads(body)["execution"] == 2  # SPEC §3.1: a new attempt under the same job
    after = await job_with_key(store, "k-1")
    assert after.id == job.id
    assert [a.number for a in after.attempts] == [1, 2]
    assert (after.state, after.resolution) == (JobState.COMPLETED, "operator")
    status, headers, _body = await post(proxy, "k-1")
    assert (status, headers["Idempotent-Replayed"]) == (201, "true")
    assert upstream.executions == 2


async def test_of_two_concurrent_resolutions_exactly_one_wins(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    for round_ in range(5):
        job = await make_unknown(proxy, upstream, store, f"k-{round_}")
        first, second = await asyncio.gather(
            resolve(admin, job.id, COMPLETED), resolve(admin, job.id, {"as": "released"})
        )
        statuses = sorted([first.status, second.status])
        assert statuses == [200, 409], statuses
        winner, loser = (first, second) if first.status == 200 else (second, first)
        problem = await assert_problem(loser, 409, loser_code := (await loser.json())["code"])
        assert loser_code in {"resolution-lost", "job-not-unknown"}, problem
        won = await winner.json()
        after = await store.get_by_id(job.id)
        assert after is not None
        assert (after.state.value, after.version) == (won["state"], job.version + 1)
        for response in (first, second):
            response.release()


async def test_resolving_a_completed_job_is_409_and_changes_nothing(
    admin: Client, proxy: Client, store: Store
) -> None:
    job = await make_completed(proxy, store, "k-1")
    for body in (COMPLETED, {"as": "released"}):
        async with await resolve(admin, job.id, body) as response:
            problem = await assert_problem(response, 409, "job-not-unknown")
        assert "completed" in problem["detail"]
    after = await store.get_by_id(job.id)
    assert after is not None
    assert (after.state, after.version, after.response) == (job.state, job.version, job.response)


async def test_resolving_needs_the_version_given(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    stale = {"as": "released", "version": job.version - 1}
    async with await resolve(admin, job.id, stale) as response:
        await assert_problem(response, 409, "version-mismatch")
    assert (await job_with_key(store, "k-1")).state is JobState.UNKNOWN
    async with await resolve(admin, job.id, {**stale, "version": job.version}) as response:
        assert response.status == 200


async def test_resolving_a_missing_job_is_404(admin: Client) -> None:
    async with await resolve(admin, str(uuid.uuid4()), {"as": "released"}) as response:
        await assert_problem(response, 404, "job-not-found")


@pytest.mark.parametrize(
    "body",
    [
        [],
        {},
        {"as": "maybe"},
        {"as": "completed"},
        {"as": "completed", "status": "201"},
        {"as": "completed", "status": True},
        {"as": "completed", "status": 99},
        {"as": "completed", "status": 600},
        {"as": "completed", "status": 204, "body": "content"},
        {"as": "completed", "status": 201, "headers": [["Content-Length", "3"]]},
        {"as": "completed", "status": 201, "headers": [["Transfer-Encoding", "chunked"]]},
        {"as": "completed", "status": 201, "headers": [["Set-Cookie", "session=x"]]},
        {"as": "completed", "status": 201, "headers": [["Idempotent-Replayed", "false"]]},
        {"as": "completed", "status": 201, "headers": [["X-Evil", "a\r\nInjected: yes"]]},
        {"as": "completed", "status": 201, "headers": [["Bad Name", "x"]]},
        {"as": "completed", "status": 201, "headers": [["X-Only-Name"]]},
        {"as": "completed", "status": 201, "headers": "Content-Type: text/plain"},
        {"as": "completed", "status": 201, "body": "a", "body_base64": "YQ=="},
        {"as": "completed", "status": 201, "body_base64": "not base64!"},
        {"as": "completed", "status": 201, "body": 42},
        {"as": "completed", "status": 201, "body": "\ud800"},
        {"as": "released", "status": 200},
        {"as": "released", "version": "1"},
        {"as": "released", "comment": "extra fields are refused"},
    ],
)
async def test_invalid_resolutions_are_400_and_change_nothing(
    admin: Client, proxy: Client, upstream: Upstream, store: Store, body: Any
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    async with await resolve(admin, job.id, body) as response:
        await assert_problem(response, 400, "invalid-request")
    after = await store.get_by_id(job.id)
    assert after is not None
    assert (after.state, after.version) == (JobState.UNKNOWN, job.version)


async def test_a_body_that_is_not_json_is_400(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    async with admin.post(f"/jobs/{job.id}/resolve", data=b"as=released") as response:
        await assert_problem(response, 400, "invalid-request")
    # Too deep for json.loads: it raised RecursionError out of the handler, a 500.
    deep = b"[" * 100_000 + b"]" * 100_000
    async with admin.post(f"/jobs/{job.id}/resolve", data=deep) as response:
        await assert_problem(response, 400, "invalid-request")


async def test_a_body_over_max_stored_body_is_refused(
    make_admin: MakeClient,
    make_settings: MakeSettings,
    proxy: Client,
    upstream: Upstream,
    store: Store,
) -> None:
    admin = await make_admin(make_settings(max_stored_body=10))
    job = await make_unknown(proxy, upstream, store, "k-1")
    for size in (11, 2 * 1024**2):  # over the setting; over the admin app's request limit
        body = {"as": "completed", "status": 200, "body": "x" * size}
        data = io.BytesIO(json.dumps(body).encode())
        headers = {"Content-Type": "application/json"}
        async with admin.post(f"/jobs/{job.id}/resolve", data=data, headers=headers) as response:
            await assert_problem(response, 400, "invalid-request")
    body = {"as": "completed", "status": 200, "body": "x" * 10}
    async with await resolve(admin, job.id, body) as response:
        assert response.status == 200


# --- delete -------------------------------------------------------------------------------------


async def test_delete_then_the_key_starts_afresh(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    job = await make_unknown(proxy, upstream, store, "k-1")
    async with admin.delete(f"/jobs/{job.id}") as response:
        assert response.status == 204
    async with admin.get(f"/jobs/{job.id}") as response:
        await assert_problem(response, 404, "job-not-found")
    async with admin.delete(f"/jobs/{job.id}") as response:
        await assert_problem(response, 404, "job-not-found")
    status, _headers, body = await post(proxy, "k-1")
    assert (status, json.loads(body)["execution"]) == (201, 2)
    assert (await job_with_key(store, "k-1")).id != job.id


async def test_deleting_a_job_in_flight_needs_force(admin: Client, store: Store) -> None:
    intent = Intent(owner="o", key="k-1", fingerprint="fp", method="POST", path="/charges")
    job_id = str(uuid.uuid4())
    await store.claim(intent, job_id, "http://upstream", ttl=3600, lease=3600)
    async with admin.delete(f"/jobs/{job_id}") as response:
        await assert_problem(response, 409, "job-in-flight")
    assert await store.get_by_id(job_id) is not None
    async with admin.delete(f"/jobs/{job_id}?force=true") as response:
        assert response.status == 204
    assert await store.get_by_id(job_id) is None


# --- the token ----------------------------------------------------------------------------------


async def test_every_jobs_route_needs_the_token_when_one_is_set(
    make_admin: MakeClient,
    make_settings: MakeSettings,
    proxy: Client,
    upstream: Upstream,
    store: Store,
) -> None:
    admin = await make_admin(make_settings(admin={"token": TOKEN}))
    job = await make_unknown(proxy, upstream, store, "k-1")
    routes = [
        ("GET", "/jobs", None),
        ("GET", f"/jobs/{job.id}", None),
        ("POST", f"/jobs/{job.id}/resolve", {"as": "released"}),
        ("DELETE", f"/jobs/{job.id}", None),
    ]
    for method, path, body in routes:
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            async with admin.request(method, path, json=body, headers=auth) as response:
                await assert_problem(response, 401, "unauthorized")
                assert response.headers["WWW-Authenticate"] == "Bearer"
    after = await store.get_by_id(job.id)
    assert after is not None
    assert (after.state, after.version) == (JobState.UNKNOWN, job.version)

    authorized = {"Authorization": f"Bearer {TOKEN}"}
    async with admin.get("/jobs", headers=authorized) as response:
        assert response.status == 200
        assert [j["id"] for j in await response.json()] == [job.id]
    async with admin.get("/healthz") as response:
        assert response.status == 200
    async with admin.get("/readyz") as response:
        assert response.status == 200


async def test_show_has_the_questions_asked_about_an_unknown_attempt(
    admin: Client, proxy: Client, upstream: Upstream, store: Store
) -> None:
    """SPEC §3.6: the evidence kept on the attempt, as the reconciler records it."""
    job = await make_unknown(proxy, upstream, store, "k-evidence")
    assert await store.claim_check(job, 1, checks=0, due_after=0)
    asked = datetime(2026, 1, 1, 3, tzinfo=UTC)
    await store.record_evidence(
        job, 1, Evidence("reconcile", asked, None, None, "unknown", "timeout")
    )
    [attempt] = (await get_json(admin, f"/jobs/{job.id}"))["attempts"]
    assert attempt["checks"] == 1 and attempt["checked_at"] is not None
    assert attempt["evidence"] == [
        {"way": "reconcile", "asked_at": asked.isoformat(), "answered_at": None, "status": None,
         "verdict": "unknown", "reason": "timeout"}
    ]  # fmt: skip
