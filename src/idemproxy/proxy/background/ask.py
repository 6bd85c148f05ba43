"""One question to a route's reconcile endpoint (SPEC §3.6): "did you execute this attempt?".

The proxy POSTs the question as JSON, with the identity headers the attempt itself carried
(SPEC §10: `Idempotency-Key`, `Idempotency-Job`, `Idempotency-Attempt`), and reads at most
`limit` bytes of the answer within the endpoint's `timeout`. Whatever goes wrong on the way (a
refused connection, a timeout, a reset, an answer too long) is no answer: it proves nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp

from idemproxy.config.resolve import ReconcileSettings
from idemproxy.constants import ATTEMPT_HEADER, DEFAULT_KEY_HEADER, JOB_HEADER
from idemproxy.core.resolution import Question
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
    """Asks reconcile endpoints over a small pool of its own, apart from the upstream client's
    (a question never waits behind request traffic)."""

    def __init__(self, limit: int, connections: int = 4) -> None:
        self._limit = limit
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._connections)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def ask(self, endpoint: ReconcileSettings, question: Question) -> Answered:
        asked_at = datetime.now(UTC)
        try:
            async with asyncio.timeout(endpoint.timeout):
                status, body = await self._post(endpoint.url, question)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            why = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
            log.info("reconcile %s: no answer about job %s (%s)", redact_url(endpoint.url),
                     question.job_id, why)  # fmt: skip
            return Answered(asked_at, None, None, None, why)
        return Answered(asked_at, datetime.now(UTC), status, body)

    async def _post(self, url: str, question: Question) -> tuple[int, bytes]:
        assert self._session is not None, "open() first"
        headers = {
            DEFAULT_KEY_HEADER: question.key,
            JOB_HEADER: question.job_id,
            ATTEMPT_HEADER: str(question.attempt),
            "Content-Type": "application/json",
        }
        data = json.dumps(question.as_json()).encode()
        async with self._session.post(
            url, data=data, headers=headers, allow_redirects=False
        ) as response:
            body = await response.content.read(self._limit + 1)
            if len(body) > self._limit:
                raise ValueError("answer too long")
            return response.status, body
