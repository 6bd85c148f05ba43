"""A job as JSON: the one shape shared by the admin API and `idemproxy jobs --json` (SPEC §13).

A stored response body may hold a tenant's data, so it is left out unless asked for explicitly
(`include_response`); the status alone is always shown.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from idemproxy.core.types import Attempt, Evidence, Job, KeptResponse, SealedResponse
from idemproxy.http.headers import stored_reason
from idemproxy.redact import redact_path, redact_url
from idemproxy.store.rows import pairs_to_json

JsonObject = dict[str, Any]


def job_to_json(
    job: Job, *, include_response: bool = False, late: Mapping[int, KeptResponse] | None = None
) -> JsonObject:
    """SPEC §13: at least id, owner, key, state, version, created_at, expires_at, attempts.

    `late`: the late responses kept on attempts (by number), shown with `include_response`.
    """
    view: JsonObject = {
        "id": job.id,
        "owner": job.owner,
        "key": job.key,
        "state": job.state.value,
        "version": job.version,
        "method": job.method,
        "path": redact_path(job.path),  # SPEC §13: a session id in it is a credential
        "created_at": timestamp(job.created_at),
        "updated_at": timestamp(job.updated_at),
        "expires_at": timestamp(job.expires_at),
        "expired": job.expired,
        "lease_expired": job.lease_expired,
        "resolution": job.resolution,
        "completed_by": job.completed_by,
        "attempt_count": job.attempt_count,
        "response_status": job.response.status if job.response else None,
        "attempts": [attempt_to_json(a) for a in job.attempts],
    }
    if include_response:
        view["response"] = response_to_json(job.response)
        for attempt in view["attempts"]:
            kept = (late or {}).get(attempt["number"])
            attempt["late_response"] = response_to_json(kept)
    return view


def attempt_to_json(attempt: Attempt) -> JsonObject:
    return {
        "number": attempt.number,
        "upstream": redact_url(attempt.upstream),
        "state": attempt.state.value,
        "status": attempt.status,
        "error": attempt.error,
        "started_at": timestamp(attempt.started_at),
        "finished_at": timestamp(attempt.finished_at),
        # SPEC §3.3: the size of a late response kept on it (`jobs resolve --from-attempt`).
        "late_response_bytes": attempt.late_bytes,
        # SPEC §3.6: the questions asked about it while unknown, and the latest answers.
        "checks": attempt.checks,
        "checked_at": timestamp(attempt.checked_at),
        "evidence": [evidence_to_json(e) for e in attempt.evidence],
    }


def evidence_to_json(evidence: Evidence) -> JsonObject:
    return {
        "way": evidence.way,
        "asked_at": timestamp(evidence.asked_at),
        "answered_at": timestamp(evidence.answered_at),
        "status": evidence.status,
        "verdict": evidence.verdict,
        "reason": evidence.reason,
    }


def response_to_json(response: KeptResponse | None) -> JsonObject | None:
    """Text bodies as `body`, anything else as `body_base64`: the same fields `resolve` takes.
    A sealed response that could not be opened (SPEC §11) shows its status and key id only."""
    if response is None:
        return None
    if isinstance(response, SealedResponse):
        return {
            "status": response.status,
            "omitted": response.omitted,
            "sealed_with": response.key_id,
        }
    reason, headers = stored_reason(response.headers)
    view: JsonObject = {"status": response.status}
    if reason is not None:  # the upstream's own phrase, which its replays carry (SPEC §7)
        try:
            view["reason"] = reason.encode().decode()
        except UnicodeEncodeError:  # bytes that are not UTF-8: as Latin-1, as a header's are
            view["reason"] = reason.encode("utf-8", "surrogateescape").decode("latin-1")
            view["reason_encoding"] = "latin-1"
    # A pair with bytes that are not UTF-8 (obs-text) comes as [name, value, "latin-1"]: JSON
    # can not carry them otherwise (store/rows.py).
    view["headers"] = pairs_to_json(headers)
    view["omitted"] = response.omitted
    if response.body is not None:
        try:
            view["body"] = response.body.decode("utf-8")
        except UnicodeDecodeError:
            view["body_base64"] = base64.b64encode(response.body).decode("ascii")
    return view


def timestamp(value: datetime | None) -> str | None:
    """ISO 8601 in UTC; both stores give aware datetimes from the database clock."""
    return None if value is None else value.astimezone(UTC).isoformat()
