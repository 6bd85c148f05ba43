"""Answering from a stored response (SPEC §7)."""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict

from idemproxy.constants import ERROR_HEADER, JOB_HEADER, REPLAY_OMITTED_HEADER, REPLAYED_HEADER
from idemproxy.types import StoredResponse


def replay_response(job_id: str, stored: StoredResponse) -> web.Response:
    """Status, end-to-end headers and body as stored; Content-Length recomputed, Date fresh."""
    headers = CIMultiDict[str](stored.headers)
    # Stored by a version that kept the upstream's own: SPEC §8 reserves it for the proxy.
    headers.popall(ERROR_HEADER, None)
    headers[REPLAYED_HEADER] = "true"
    headers[JOB_HEADER] = job_id
    if stored.omitted:
        # SPEC §7: the body was too large to keep; the duplicate still never re-executes.
        headers[REPLAY_OMITTED_HEADER] = "omitted"
    return web.Response(status=stored.status, body=stored.body or b"", headers=headers)
