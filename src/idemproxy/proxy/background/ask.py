"""One question to a route's reconcile endpoint (SPEC §3.6): "did you execute this attempt?".

The proxy POSTs the question as JSON, with the identity headers the attempt itself carried
(SPEC §10: `Idempotency-Key`, `Idempotency-Job`, `Idempotency-Attempt`), and reads at most
`limit` bytes of the answer within the endpoint's `timeout`. It goes the way the attempt went:
through the upstream client (its TLS settings and egress proxy for the endpoint's origin,
proxy/upstream/dial.py), with the header edits of the attempt's route and upstream
(`upstream_headers`: a backend that wants credentials from the proxy gets them here too).
Whatever goes wrong on the way (a refused connection, a timeout, a reset, an answer too long)
is no answer: it proves nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from multidict import CIMultiDict
from yarl import URL

from idemproxy.config.resolve import ReconcileSettings
from idemproxy.constants import ATTEMPT_HEADER, DEFAULT_KEY_HEADER, JOB_HEADER
from idemproxy.core.resolution import Question
from idemproxy.http.headers import Edits
from idemproxy.proxy.upstream.client import UpstreamClient, UpstreamFailure
from idemproxy.redact import redact_url

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Answered:
    """What came back: `status` and `body` None when nothing did, and why (`error`)."""

    asked_at: datetime
    answered_at: datetime | None
    status: int | None
    body: bytes | None
    error: str | None = None


class ReconcileClient:
    """Asks reconcile endpoints through the process's upstream client, which the caller opens
    and closes."""

    def __init__(self, upstream: UpstreamClient, limit: int) -> None:
        self._upstream = upstream
        self._limit = limit

    async def ask(
        self, endpoint: ReconcileSettings, question: Question, edits: Edits = ()
    ) -> Answered:
        asked_at = datetime.now(UTC)
        try:
            async with asyncio.timeout(endpoint.timeout):
                status, body = await self._post(endpoint, question, edits)
        except (TimeoutError, UpstreamFailure, OSError, ValueError) as exc:
            why = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
            log.info("reconcile %s: no answer about job %s (%s)", redact_url(endpoint.url),
                     question.job_id, why)  # fmt: skip
            return Answered(asked_at, None, None, None, why)
        return Answered(asked_at, datetime.now(UTC), status, body)

    async def _post(
        self, endpoint: ReconcileSettings, question: Question, edits: Edits
    ) -> tuple[int, bytes]:
        headers: CIMultiDict[str] = CIMultiDict()
        for edit in edits:  # the route's `upstream_headers`, then the upstream's (SPEC §10)
            edit.apply(headers)
        headers[DEFAULT_KEY_HEADER] = question.key
        headers[JOB_HEADER] = question.job_id
        headers[ATTEMPT_HEADER] = str(question.attempt)
        headers["Content-Type"] = "application/json"
        # The upstream client never decodes a body (SPEC §10): the answer is asked for as is.
        headers["Accept-Encoding"] = "identity"
        data = json.dumps(question.as_json()).encode()
        url = URL(endpoint.url)
        timeout = endpoint.timeout
        exchange = self._upstream.request(
            "POST", url, headers, data, content_length=len(data), timeout=timeout
        )
        async with exchange as response:
            body, whole = await UpstreamClient.read_body(response, self._limit)
            if not whole:
                raise ValueError("answer too long")
            return response.status, body
