"""Problem responses the proxy produces itself (SPEC §8, RFC 9457)."""

from __future__ import annotations

import json

from aiohttp import web

from idemproxy.constants import (
    ERROR_HEADER,
    JOB_INSTANCE_PREFIX,
    PROBLEM_CONTENT_TYPE,
    PROBLEM_TYPE_PREFIX,
)
from idemproxy.errors import NEVER, NO_JOB, OperatorError, PayloadMismatch, ProblemError, one_line
from idemproxy.http.headers import CURRENT

# SPEC §8 / draft-ietf-httpapi-idempotency-key-header-07 §2.7: a reused key with another
# payload is 422 in the ietf profile.
IETF_MISMATCH_STATUS = 422


def problem_type(code: str, types: str | None = None) -> str:
    """The `type` URI of `code`: its anchor in the published docs/problems.md when `types`
    (the `problem_types` setting) names where it is, else the URN of SPEC §8."""
    if types:
        return f"{types}#{code}"
    return PROBLEM_TYPE_PREFIX + code


def problem_response(
    error: ProblemError, *, profile: str = "default", types: str | None = None
) -> web.Response:
    status = error.status
    if isinstance(error, PayloadMismatch) and profile == "ietf":
        status = IETF_MISMATCH_STATUS
    body: dict[str, object] = {
        "type": problem_type(error.code, types),
        "title": error.title,
        "status": status,
        # Always our own text, never attacker bytes (SPEC §8); one line, whoever wrote it.
        "detail": one_line(error.detail),
        "code": error.code,
    }
    if not isinstance(error, OperatorError):
        _where_the_client_stands(body, error)
    if error.members:
        body.update(error.members)
    headers = {ERROR_HEADER: error.code}
    correlation = CURRENT.get()
    if correlation is not None:  # what support is asked about joins the proxy's log lines
        body["request_id"] = correlation.request_id
        headers[correlation.header] = correlation.request_id
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        content_type=PROBLEM_CONTENT_TYPE,
        headers=headers,
    )


def _where_the_client_stands(body: dict[str, object], error: ProblemError) -> None:
    """SPEC §8: the job the answer is about, its state, and what the client may do next."""
    state = error.job_state or NO_JOB  # a pass-through request's problem is about no job
    if error.job_id is not None:
        body["instance"] = JOB_INSTANCE_PREFIX + error.job_id
    body["job_state"] = state
    # A job whose outcome is unknown may have executed: no retry can be safe until an operator
    # resolves it (SPEC §3.3), whatever the code says.
    body["retry"] = NEVER if state == "unknown" else error.retry
