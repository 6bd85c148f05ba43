"""Answering from a stored response (SPEC §7)."""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict

from idemproxy.constants import ERROR_HEADER, JOB_HEADER, REPLAY_OMITTED_HEADER, REPLAYED_HEADER
from idemproxy.core.types import StoredResponse
from idemproxy.http.headers import REASON_FIELD, stored_reason
from idemproxy.proxy.server.capture import ResponseBudget, SpooledResponse, on_disk
from idemproxy.proxy.server.connection import ONE_WRITE_BODY, AsSentResponse, NotifiedResponse


def replay_response(
    job_id: str,
    stored: StoredResponse,
    shared: SharedBodies | None = None,
    *,
    decoded: bool = False,
) -> web.StreamResponse:
    """Status, end-to-end headers and body as stored; Content-Length recomputed, Date fresh.
    `decoded`: the body is the stored one decoded for this retry (proxy/server/fit.py), not the
    one the job's other replays share."""
    body = stored.body or b""
    fields, reason = stored.headers, None
    if fields and fields[0][0] == REASON_FIELD:  # the upstream's own phrase (SPEC §7)
        reason, fields = stored_reason(fields)
    if shared is None or len(body) <= ONE_WRITE_BODY:
        # aiohttp copies the fields into a CIMultiDict of its own: marked there, not copied
        # into one of ours first.
        response = AsSentResponse(status=stored.status, reason=reason, body=body, headers=fields)
        _mark_replayed(response.headers, job_id, stored)
        return response
    headers = CIMultiDict[str](fields)
    _mark_replayed(headers, job_id, stored)
    # A decoded body is shared with the job's other decoded replays only (all are the same).
    held = job_id + "/identity" if decoded else job_id
    return shared.response(held, stored.status, headers, body, reason)


def _mark_replayed(headers: CIMultiDict[str], job_id: str, stored: StoredResponse) -> None:
    # Stored by a version that kept the upstream's own: SPEC §8 reserves it for the proxy.
    headers.popall(ERROR_HEADER, None)
    headers[REPLAYED_HEADER] = "true"
    headers[JOB_HEADER] = job_id
    if stored.omitted:
        # SPEC §7: the body was too large to keep; the duplicate still never re-executes.
        headers[REPLAY_OMITTED_HEADER] = "omitted"


class SharedBodies:
    """The large stored bodies being replayed right now, one bytes object per job, counted
    against the response budget (proxy/server/capture.py): a thousand duplicates of an 8 MiB
    response woken at once hold 8 MiB while they are written, not 8 GB. A body the budget has
    no room for is written to a temporary file and its client answered from there, so that slow
    clients of many distinct large jobs hold disk rather than memory. Each read of a job still
    brings its own copy from the store, dropped as soon as the replay is built (the reads in
    flight are bounded by the store's connection pool)."""

    def __init__(self, budget: ResponseBudget) -> None:
        self._budget = budget
        self._bodies: dict[str, tuple[bytes, int]] = {}

    def response(
        self,
        job_id: str,
        status: int,
        headers: CIMultiDict[str],
        body: bytes,
        reason: str | None = None,
    ) -> web.StreamResponse:
        # A completed job's body never changes (SPEC §3.2: `completed` is terminal).
        held, users = self._bodies.get(job_id, (body, 0))
        if not users and not self._budget.try_take(len(body)):
            return SpooledResponse(
                on_disk(self._budget, body), status=status, reason=reason, headers=headers
            )
        self._bodies[job_id] = (held, users + 1)
        # Given back once written, or after the budget's `hold` when its client does not read
        # (the bytes stay, shared, until written).
        return NotifiedResponse(
            status=status,
            reason=reason,
            body=held,
            headers=headers,
            done=lambda: self._give_back(job_id),
            hold=self._budget.hold,
        )

    def _give_back(self, job_id: str) -> None:
        held, users = self._bodies[job_id]
        if users > 1:
            self._bodies[job_id] = (held, users - 1)
            return
        del self._bodies[job_id]
        self._budget.give_back(len(held))

    @property
    def size(self) -> int:
        return sum(len(body) for body, _ in self._bodies.values())
