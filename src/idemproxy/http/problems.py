"""Problem responses the proxy produces itself (SPEC §8, RFC 9457)."""

from __future__ import annotations

import json

from aiohttp import web

from idemproxy.constants import ERROR_HEADER, PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_PREFIX
from idemproxy.errors import PayloadMismatch, ProblemError, one_line

# SPEC §8 / draft-ietf-httpapi-idempotency-key-header-07 §2.7: a reused key with another
# payload is 422 in the ietf profile.
IETF_MISMATCH_STATUS = 422


def problem_response(error: ProblemError, *, profile: str = "default") -> web.Response:
    status = error.status
    if isinstance(error, PayloadMismatch) and profile == "ietf":
        status = IETF_MISMATCH_STATUS
    body = {
        "type": PROBLEM_TYPE_PREFIX + error.code,
        "title": error.title,
        "status": status,
        # Always our own text, never attacker bytes (SPEC §8); one line, whoever wrote it.
        "detail": one_line(error.detail),
        "code": error.code,
    }
    headers = {ERROR_HEADER: error.code}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        content_type=PROBLEM_CONTENT_TYPE,
        headers=headers,
    )
