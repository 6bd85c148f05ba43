"""`idemproxy jobs …` as real processes on a real store (SPEC §3.3, §13)."""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from idemproxy.core.types import Claimed, Evidence, Intent, Job, JobState, StoredResponse
from idemproxy.store.factory import create_store
from tests.support.client import send
from tests.support.loop import run_private as run  # the tests themselves are synchronous

if TYPE_CHECKING:
    from .conftest import Backend, CliRun, RunCli, StartProxy

pytestmark = pytest.mark.slow

JOB_FIELDS = {"id", "owner", "key", "state", "version", "created_at", "expires_at", "attempts"}
ATTEMPT_FIELDS = {"number", "upstream", "state", "status", "error", "started_at", "finished_at"}
ALICE = hashlib.sha256(b"Bearer alice").hexdigest()
BOB = hashlib.sha256(b"Bearer bob").hexdigest()
SECRET = b'{"card": "4242-secret"}'


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("citus", marks=pytest.mark.citus),
    ]
)
def dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/jobs.db"
    pg: str = request.getfixturevalue("citus_dsn" if request.param == "citus" else "pg_dsn")
    return pg


async def _prepare(dsn: str) -> dict[str, Job]:
    """Two unknown jobs (alice, bob) and one completed one, as the proxy would leave them."""
    store = create_store(dsn)
    await store.open()
    try:
        await store.migrate()
        jobs: dict[str, Job] = {}
        for name, owner in (("lost", ALICE), ("bobs", BOB), ("done", ALICE)):
            intent = Intent(owner, f"order-{name}", "fp", "POST", "/charges")
            claimed = await store.claim(
                intent, str(uuid.uuid4()), "http://upstream:3000", ttl=3600, lease=30
            )
            assert isinstance(claimed, Claimed)
            if name == "done":
                response = StoredResponse(201, (("Content-Type", "application/json"),), SECRET)
                assert await store.complete(claimed.job, 1, response, ttl=3600)
            else:
                assert await store.settle(claimed.job, 1, JobState.UNKNOWN, error="timeout")
            found = await store.get_by_id(claimed.job.id)
            assert found is not None
            jobs[name] = found
        return jobs
    finally:
        await store.close()


async def _load(dsn: str, job_id: str) -> Job | None:
    store = create_store(dsn)
    await store.open()
    try:
        return await store.get_by_id(job_id)
    finally:
        await store.close()


def ok(done: CliRun) -> CliRun:
    assert done.returncode == 0, done
    assert "Traceback" not in done.stderr, done.stderr
    return done


def failed(done: CliRun, code: int, message: str) -> None:
    assert done.returncode == code, done
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_list_is_a_readable_table_and_json_is_spec_shaped(dsn: str, run_cli: RunCli) -> None:
    jobs = run(_prepare(dsn))
    table = ok(run_cli("jobs", "list", "--store", dsn)).stdout.splitlines()
    assert table[0].split() == [
        "ID", "STATE", "VER", "ATT", "STATUS", "KEY", "OWNER", "UPDATED", "RESOLUTION"
    ]  # fmt: skip
    assert len(table) == 4
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert rows[jobs["lost"].id][1:3] == ["unknown", str(jobs["lost"].version)]
    assert rows[jobs["done"].id][1:5] == ["completed", str(jobs["done"].version), "1", "201"]
    # Aligned: every row's state and key start under their column headings.
    for heading in ("STATE", "KEY"):
        column = table[0].index(heading)
        for line in table[1:]:
            assert line[column - 2 : column] == "  " and line[column] != " ", (heading, line)

    listed = json.loads(ok(run_cli("jobs", "list", "--store", dsn, "--json")).stdout)
    assert isinstance(listed, list)
    assert {job["id"] for job in listed} == {job.id for job in jobs.values()}
    for job in listed:
        assert set(job) >= JOB_FIELDS
        [attempt] = job["attempts"]
        assert set(attempt) >= ATTEMPT_FIELDS
    assert "4242-secret" not in json.dumps(listed)  # stored bodies stay out of listings

    filtered = run_cli(
        "jobs", "list", "--store", dsn, "--state", "unknown", "--owner", ALICE, "--json"
    )
    assert [job["id"] for job in json.loads(ok(filtered).stdout)] == [jobs["lost"].id]
    limited = run_cli("jobs", "list", "--store", dsn, "--limit", "1", "--json")
    assert len(json.loads(ok(limited).stdout)) == 1


def test_show_one_job_with_its_attempts(dsn: str, run_cli: RunCli) -> None:
    jobs = run(_prepare(dsn))
    lost = jobs["lost"]
    shown = json.loads(ok(run_cli("jobs", "show", lost.id, "--store", dsn, "--json")).stdout)
    assert isinstance(shown, dict)
    assert set(shown) >= JOB_FIELDS | {"resolution", "completed_by", "updated_at"}
    assert (shown["id"], shown["owner"], shown["key"]) == (lost.id, ALICE, "order-lost")
    assert (shown["state"], shown["version"]) == ("unknown", lost.version)
    [attempt] = shown["attempts"]
    assert (attempt["number"], attempt["upstream"], attempt["state"]) == (
        1,
        "http://upstream:3000",
        "unknown",
    )
    assert attempt["error"] == "timeout"

    text = ok(run_cli("jobs", "show", lost.id, "--store", dsn)).stdout
    assert f"job           {lost.id}" in text
    assert f"state         unknown (version {lost.version})" in text
    attempts = text.split("\nattempts\n", 1)[1].splitlines()
    assert attempts[0].split() == [
        "#",
        "UPSTREAM",
        "STATE",
        "STATUS",
        "STARTED",
        "FINISHED",
        "ERROR",
    ]
    assert attempts[1].split()[:3] == ["1", "http://upstream:3000", "unknown"]

    done = jobs["done"].id
    assert "4242-secret" not in ok(run_cli("jobs", "show", done, "--store", dsn, "--json")).stdout
    assert "4242-secret" not in ok(run_cli("jobs", "show", done, "--store", dsn)).stdout
    full = run_cli("jobs", "show", done, "--store", dsn, "--json", "--include-response")
    assert json.loads(ok(full).stdout)["response"]["body"] == SECRET.decode()
    assert (
        SECRET.decode()
        in ok(run_cli("jobs", "show", done, "--store", dsn, "--include-response")).stdout
    )


async def _resent(dsn: str, job: Job) -> None:
    """Evidence of a resend under the key the upstream honours, on the attempt it was about:
    a resend never counts a question (`checks`)."""
    store = create_store(dsn)
    await store.open()
    try:
        at = datetime.now(UTC)
        why = "sent again as attempt 2: unknown"
        await store.record_evidence(job, 1, Evidence("upstream_key", at, at, 409, "unknown", why))
    finally:
        await store.close()


def test_show_lists_the_evidence_of_a_resend(dsn: str, run_cli: RunCli) -> None:
    """SPEC §3.6: what was asked and answered is shown, by either way."""
    lost = run(_prepare(dsn))["lost"]
    run(_resent(dsn, lost))
    text = ok(run_cli("jobs", "show", lost.id, "--store", dsn)).stdout
    evidence = text.split("attempt 1 asked about", 1)[1]
    assert "upstream_key" in evidence and "sent again as attempt 2: unknown" in evidence
    shown = json.loads(ok(run_cli("jobs", "show", lost.id, "--store", dsn, "--json")).stdout)
    assert [e["way"] for e in shown["attempts"][0]["evidence"]] == ["upstream_key"]


def test_find_a_job_by_key_and_owner(dsn: str, run_cli: RunCli, tmp_path: Path) -> None:
    jobs = run(_prepare(dsn))
    credential = tmp_path / "credential"
    credential.write_text("Bearer alice\n")
    windows = tmp_path / "windows-credential"
    # Saved by a Windows editor: a byte order mark, a space before its CRLF line end.
    windows.write_bytes("\ufeffBearer alice \r\n".encode())
    for who in (
        ("--owner", ALICE),
        ("--owner", ALICE.upper()),
        ("--credential-file", str(credential)),
        ("--credential-file", str(windows)),
    ):
        done = ok(run_cli("jobs", "find", "order-lost", *who, "--store", dsn, "--json"))
        found = json.loads(done.stdout)
        assert (found["id"], found["state"], found["key"]) == (
            jobs["lost"].id,
            "unknown",
            "order-lost",
        )
    text = ok(run_cli("jobs", "find", "order-done", "--owner", ALICE, "--store", dsn)).stdout
    assert f"job           {jobs['done'].id}" in text and "4242-secret" not in text
    shown = run_cli(
        "jobs", "find", "order-done", "--owner", ALICE, "--store", dsn, "--include-response"
    )
    assert SECRET.decode() in ok(shown).stdout
    # Bob's key in Alice's scope, or a webhook sender's: not found.
    failed(run_cli("jobs", "find", "order-bobs", "--owner", ALICE, "--store", dsn), 1, "no job")
    failed(run_cli("jobs", "find", "order-bobs", "--sender", "shop", "--store", dsn), 1, "no job")


def test_resolve_and_delete(dsn: str, run_cli: RunCli, tmp_path: Path) -> None:
    jobs = run(_prepare(dsn))
    lost, bobs = jobs["lost"], jobs["bobs"]
    body = tmp_path / "body.json"
    body.write_bytes(b'{"charge": 42}')
    resolved = run_cli(
        "jobs", "resolve", lost.id, "--store", dsn, "--as", "completed", "--status", "201",
        "--header", "Content-Type: application/json", "--header", "Location: /charges/42",
        "--body-file", str(body),
    )  # fmt: skip
    assert f"job {lost.id}: resolved as completed (status 201)" in ok(resolved).stdout
    after = run(_load(dsn, lost.id))
    assert after is not None
    assert (after.state, after.version, after.resolution) == (
        JobState.COMPLETED,
        lost.version + 1,
        "operator",
    )
    assert after.response == StoredResponse(
        201, (("Content-Type", "application/json"), ("Location", "/charges/42")), b'{"charge": 42}'
    )
    again = run_cli("jobs", "resolve", lost.id, "--store", dsn, "--as", "released")
    failed(again, 1, "only an unknown job can be resolved")

    stale = run_cli(
        "jobs", "resolve", bobs.id, "--store", dsn, "--as", "released",
        "--expect-version", str(bobs.version + 5),
    )  # fmt: skip
    failed(stale, 1, f"is at version {bobs.version}")
    released = run_cli(
        "jobs", "resolve", bobs.id, "--store", dsn, "--as", "released", "--json",
        "--expect-version", str(bobs.version),
    )  # fmt: skip
    view = json.loads(ok(released).stdout)
    assert (view["state"], view["resolution"]) == ("released", "operator")

    deleted = ok(run_cli("jobs", "delete", bobs.id, "--store", dsn))
    assert f"job {bobs.id}: deleted" in deleted.stdout
    assert run(_load(dsn, bobs.id)) is None
    failed(run_cli("jobs", "delete", bobs.id, "--store", dsn), 1, "not found")
    failed(run_cli("jobs", "show", bobs.id, "--store", dsn), 1, "not found")
    missing = str(uuid.uuid4())
    failed(run_cli("jobs", "resolve", missing, "--store", dsn, "--as", "released"), 1, "not found")


def test_the_store_comes_from_the_environment_too(dsn: str, run_cli: RunCli) -> None:
    jobs = run(_prepare(dsn))
    listed = run_cli("jobs", "list", "--json", env={"IDEMPROXY_STORE": dsn})
    assert {job["id"] for job in json.loads(ok(listed).stdout)} == {j.id for j in jobs.values()}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--as", "completed"], "--as completed needs --status N"),
        (["--as", "released", "--status", "200"], "--as released takes no --status"),
        (["--as", "completed", "--status", "200", "--header", "no colon"], "'Name: value'"),
        (
            ["--as", "completed", "--status", "200", "--header", "Content-Length: 3"],
            "never replayed",
        ),
        (["--as", "completed", "--status", "99"], "200-599"),
        (["--as", "completed", "--status", "200", "--body-file", "missing.bin"], "cannot read"),
        (["--as", "maybe"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_and_change_nothing(
    tmp_path: Path, run_cli: RunCli, args: list[str], message: str
) -> None:
    dsn = f"sqlite:///{tmp_path}/jobs.db"
    lost = run(_prepare(dsn))["lost"]
    failed(run_cli("jobs", "resolve", lost.id, "--store", dsn, *args), 2, message)
    after = run(_load(dsn, lost.id))
    assert after is not None
    assert (after.state, after.version) == (JobState.UNKNOWN, lost.version)


@pytest.mark.parametrize("command", [["list"], ["find", "the-key"]])
def test_the_owner_prefix_a_log_line_shows_is_refused_not_matched_to_nothing(
    tmp_path: Path, run_cli: RunCli, command: list[str]
) -> None:
    """`owner=c1176781` on a log line is the first 8 hex digits: `--owner c1176781` said "No
    jobs" (or no job of the owner has the key) when the owner has jobs."""
    dsn = f"sqlite:///{tmp_path}/jobs.db"
    run(_prepare(dsn))
    for wrong in (ALICE[:8], ALICE + "0", ALICE[:8] + "...", f"owner={ALICE[:8]}"):
        failed(run_cli("jobs", *command, "--owner", wrong, "--store", dsn), 2, "all 64 hex digits")
    for whole in (ALICE, ALICE.upper()):
        listed = run_cli("jobs", "list", "--owner", whole, "--json", "--store", dsn)
        assert json.loads(ok(listed).stdout), "the whole hash finds the owner's jobs"


def test_a_missing_sqlite_file_is_a_usage_error_not_a_new_database(
    tmp_path: Path, run_cli: RunCli
) -> None:
    failed(run_cli("jobs", "list", "--store", "sqlite:///typo.db"), 2, "no SQLite database")
    assert not (tmp_path / "typo.db").exists()
    failed(run_cli("jobs", "list"), 2, f"no SQLite database at {tmp_path / 'idemproxy.db'}")


def test_an_unreachable_store_says_so(run_cli: RunCli) -> None:
    store = "postgresql://nobody@127.0.0.1:9/none"  # discard port: refused at once
    said = "cannot reach PostgreSQL at 127.0.0.1:9/none: connection refused"
    failed(run_cli("jobs", "list", "--store", store, timeout=20), 1, said)


async def test_an_operator_resolves_a_real_unknown_job(
    tmp_path: Path, backend: Backend, start_proxy: StartProxy, run_cli: RunCli
) -> None:
    dsn = f"sqlite:///{tmp_path}/proxy.db"
    proxy = await start_proxy("--upstream", backend.url, "--store", dsn)
    url = f"{proxy.url}/charges?status=504"  # SPEC §3.2: a gateway timeout may have executed
    async with aiohttp.ClientSession() as session:
        assert (await send(session, url, key="k-1")).status == 504
        held = await send(session, url, key="k-1")
        assert (held.status, held.error) == (409, "outcome-unknown")

        listed = run_cli("jobs", "list", "--store", dsn, "--state", "unknown", "--json")
        [job] = json.loads(ok(listed).stdout)
        assert (job["key"], job["attempts"][0]["status"]) == ("k-1", 504)
        body = tmp_path / "answer.json"
        body.write_bytes(b'{"charge": "resolved"}')
        resolved = run_cli(
            "jobs", "resolve", job["id"], "--store", dsn, "--as", "completed", "--status", "201",
            "--header", "Content-Type: application/json", "--body-file", str(body),
        )  # fmt: skip
        ok(resolved)

        replay = await send(session, url, key="k-1")
        assert (replay.status, replay.body, replay.replayed) == (201, body.read_bytes(), True)
        assert replay.headers["Content-Type"] == "application/json"
    assert backend.ledger.count("k-1") == 1  # executed once, never again


def test_purge_lists_what_it_leaves_then_erases_it_when_told(
    dsn: str, run_cli: RunCli, tmp_path: Path
) -> None:
    jobs = run(_prepare(dsn))
    credential = tmp_path / "alice.credential"
    credential.write_text("Bearer alice\n")  # as a Secret is mounted: one trailing line break
    left = run_cli("jobs", "purge", "--store", dsn, "--credential-file", str(credential))
    assert left.returncode == 1, left  # something was left: the operator must decide
    # No Redis was given: the purge cannot reach entries the proxies keep there, and says so.
    assert "warning: no Redis given (--redis or redis.url)" in left.stderr
    assert "replayed, until their redis.ttl runs out" in left.stderr
    assert f"owner {ALICE}: removed 1 jobs (1 completed) and 1 attempts" in left.stdout
    assert f"{jobs['lost'].id}  unknown" in left.stdout and "--include-in-flight" in left.stdout
    assert run(_load(dsn, jobs["done"].id)) is None
    assert run(_load(dsn, jobs["lost"].id)) is not None

    done = ok(run_cli("jobs", "purge", "--store", dsn, "--owner", ALICE, "--include-in-flight",
                      "--json"))  # fmt: skip
    report = json.loads(done.stdout)
    assert (report["removed_jobs"], report["removed_by_state"], report["left"]) == (
        1, {"unknown": 1}, []
    )  # fmt: skip
    assert run(_load(dsn, jobs["lost"].id)) is None
    assert run(_load(dsn, jobs["bobs"].id)) is not None  # another owner's job is untouched
    usage = run_cli("jobs", "purge", "--store", dsn)
    assert usage.returncode == 2 and "--owner" in usage.stderr
