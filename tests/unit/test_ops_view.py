"""The job view and its text rendering: pure functions (SPEC §13)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from idemproxy.core.types import Attempt, AttemptState, Evidence, Job, JobState, StoredResponse
from idemproxy.ops.invalidations import redis_cli
from idemproxy.ops.resolution import ResponseRules, completed, parse_header_line
from idemproxy.ops.service import resolution_ttl
from idemproxy.ops.table import job_details, jobs_table
from idemproxy.ops.view import job_to_json
from idemproxy.redact import redact_url

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def job(**changes: object) -> Job:
    fields: dict[str, object] = {
        "id": "j-1",
        "owner": "o" * 64,
        "key": "k-1",
        "fingerprint": "fp",
        "state": JobState.COMPLETED,
        "version": 2,
        "attempt_count": 1,
        "method": "POST",
        "path": "/charges",
        "completed_by": 1,
        "response": StoredResponse(201, (("Content-Type", "text/plain"),), b"secret"),
        "created_at": T0,
        "updated_at": T0,
        "expires_at": T0 + timedelta(hours=1),
        "attempts": (Attempt(1, "http://u", AttemptState.SUCCEEDED, 201, None, T0, T0),),
    }
    fields.update(changes)
    return Job(**fields)  # type: ignore[arg-type]


def test_the_body_is_only_in_the_view_when_asked_for() -> None:
    view = job_to_json(job())
    assert view["response_status"] == 201
    assert "secret" not in str(view)
    full = job_to_json(job(), include_response=True)
    assert full["response"] == {
        "status": 201,
        "headers": [["Content-Type", "text/plain"]],
        "omitted": False,
        "body": "secret",
    }
    binary = job_to_json(job(response=StoredResponse(200, (), b"\xff")), include_response=True)
    assert binary["response"]["body_base64"] == "/w=="
    omitted = job_to_json(job(response=StoredResponse(200, (), None)), include_response=True)
    assert omitted["response"] == {"status": 200, "headers": [], "omitted": True}


def test_times_are_iso_8601_in_utc() -> None:
    paris = timezone(timedelta(hours=1))
    view = job_to_json(job(created_at=T0.astimezone(paris)))
    assert view["created_at"] == "2025-01-02T03:04:05+00:00"


def test_upstream_passwords_are_redacted() -> None:
    assert redact_url("http://user:pw@host:3000/x") == "http://user:***@host:3000/x"
    assert redact_url("http://host:3000") == "http://host:3000"


def test_text_output_cannot_carry_control_characters() -> None:
    evil = job(key="k\x1b[2J", path="/x\r\nforged line")
    assert "\x1b" not in jobs_table([job_to_json(evil)])
    details = job_details(job_to_json(evil))
    assert "\x1b" not in details
    assert "forged line" in details.splitlines()[4]


def test_resolution_lives_as_long_as_the_job_was_claimed_for() -> None:
    assert resolution_ttl(job(), default=60.0) == 3600.0
    assert resolution_ttl(job(created_at=None), default=60.0) == 60.0


def test_cli_header_lines() -> None:
    assert parse_header_line("Content-Type:  application/json ") == (
        "Content-Type",
        "application/json",
    )
    rules = ResponseRules(unreplayed_headers=["set-cookie"], max_body=10)
    resolution = completed(201, [parse_header_line("X-A: 1"), ("x-a", "2")], b"", rules)
    assert resolution.response == StoredResponse(201, (("X-A", "1"), ("x-a", "2")), b"")


def test_the_questions_about_an_unknown_attempt_are_shown() -> None:
    """SPEC §3.6: evidence on the attempt, in the JSON view and the text of `jobs show`."""
    asked = Evidence("reconcile", T0, T0 + timedelta(seconds=1), 200, "executed", "executed")
    attempt = Attempt(1, "http://u", AttemptState.UNKNOWN, None, "timeout", T0, T0,
                      checks=3, checked_at=T0, evidence=(asked,))  # fmt: skip
    resolved = job(attempts=(attempt,), completed_by=0, resolution="reconcile")
    view = job_to_json(resolved)
    (shown,) = view["attempts"]
    assert shown["checks"] == 3
    assert shown["evidence"] == [
        {
            "way": "reconcile",
            "asked_at": T0.isoformat(),
            "answered_at": (T0 + timedelta(seconds=1)).isoformat(),
            "status": 200,
            "verdict": "executed",
            "reason": "executed",
        }
    ]
    text = job_details(view)
    assert "completed by  reconcile" in text
    assert "attempt 1 asked about 3 time(s)" in text
    assert "reconcile" in text.split("asked about")[1] and "executed" in text
    assert "asked about" not in job_details(job_to_json(job()))


def test_a_session_id_in_the_path_is_masked_in_the_view_and_the_table() -> None:
    """SPEC §13: `;jsessionid=` and ASP.NET's `(S(…))` are credentials, masked as log lines
    mask them; the rest of the path is kept as the client sent it."""
    stored = job(path="/(S(abc123))/pay;jsessionid=SECRET42;v=1")
    view = job_to_json(stored)
    assert view["path"] == "/(S(***))/pay;jsessionid=***;v=1"
    assert "SECRET42" not in job_details(view) and "abc123" not in job_details(view)
    assert job_to_json(job(path="/charges;v=1"))["path"] == "/charges;v=1"


@pytest.mark.parametrize(
    ("url", "command"),
    [
        ("redis://127.0.0.1:6380?db=3", "redis-cli -h 127.0.0.1 -p 6380 -n 3"),
        ("redis://:s3cret@cache/5", "redis-cli -h cache -p 6379 -n 5"),
        ("rediss://default:s3cret@cache:6380/1", "redis-cli -h cache -p 6380 --tls -n 1"),
        ("unix:///run/redis.sock?db=2", "redis-cli -s /run/redis.sock -n 2"),
        ("redis://cache", "redis-cli -h cache -p 6379 -n 0"),
    ],
)
def test_the_unlink_remedy_names_the_server_and_database_redis_py_uses(
    url: str, command: str
) -> None:
    """The CLI's remedy for invalidations Redis did not take (SPEC §11): the database as
    redis-py reads the URL (`?db=` first), a socket's path as the socket, never the password."""
    assert redis_cli(url) == command
