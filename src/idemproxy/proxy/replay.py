"""Answering from a stored response (SPEC §7)."""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict

from idemproxy.constants import JOB_HEADER, REPLAY_OMITTED_HEADER, REPLAYED_HEADER
from idemproxy.proxy.whole import ONE_WRITE_BODY, NotifiedResponse
from idemproxy.types import StoredResponse


def replay_response(
    job_id: str, stored: StoredResponse, shared: SharedBodies | None = None
) -> web.Response:
    """Status, end-to-end headers and body as stored; Content-Length recomputed, Date fresh."""
    headers = CIMultiDict[str](stored.headers)
    headers[REPLAYED_HEADER] = "true"
    headers[JOB_HEADER] = job_id
    if stored.omitted:
        # SPEC §7: the body was too large to keep; the duplicate still never re-executes.
        headers[REPLAY_OMITTED_HEADER] = "omitted"
    body = stored.body or b""
    if shared is None or len(body) <= ONE_WRITE_BODY:
        return web.Response(status=stored.status, body=body, headers=headers)
    return NotifiedResponse(
        status=stored.status,
        body=shared.take(job_id, body),
        headers=headers,
        done=lambda: shared.give_back(job_id),
    )


class SharedBodies:
    """The large stored bodies being replayed right now, one bytes object per job: a thousand
    duplicates of an 8 MiB response woken at once hold 8 MiB while they are written, not 8 GB.
    Each read of the job still brings its own copy from the store, dropped as soon as the
    replay is built (the reads in flight are bounded by the store's connection pool)."""

    def __init__(self) -> None:
        self._bodies: dict[str, tuple[bytes, int]] = {}

    def take(self, job_id: str, body: bytes) -> bytes:
        # A completed job's body never changes (SPEC §3.2: `completed` is terminal).
        held, users = self._bodies.get(job_id, (body, 0))
        self._bodies[job_id] = (held, users + 1)
        return held

    def give_back(self, job_id: str) -> None:
        held, users = self._bodies[job_id]
        if users > 1:
            self._bodies[job_id] = (held, users - 1)
        else:
            del self._bodies[job_id]

    @property
    def size(self) -> int:
        return sum(len(body) for body, _ in self._bodies.values())
