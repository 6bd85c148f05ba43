"""A tiny HTTP client for the end-to-end tests: one request, the whole answer, when it arrived."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy

from idemproxy.constants import ERROR_HEADER, JOB_HEADER, REPLAYED_HEADER


@dataclass(frozen=True)
class Answer:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    sent_at: float  # time.monotonic() just before the request went out
    done_at: float  # time.monotonic() once the whole body was read

    @property
    def job(self) -> str | None:
        return self.headers.get(JOB_HEADER)

    @property
    def replayed(self) -> bool:
        return self.headers.get(REPLAYED_HEADER) == "true"

    @property
    def error(self) -> str | None:
        return self.headers.get(ERROR_HEADER)


async def send(
    session: aiohttp.ClientSession,
    url: str,
    *,
    key: str | None = None,
    method: str = "POST",
    body: bytes = b'{"amount": 100}',
    headers: dict[str, str] | None = None,
    **options: Any,
) -> Answer:
    all_headers = {"Content-Type": "application/json", "Authorization": "Bearer e2e-user"}
    if key is not None:
        all_headers["Idempotency-Key"] = key
    all_headers.update(headers or {})
    sent_at = time.monotonic()
    async with session.request(method, url, data=body, headers=all_headers, **options) as resp:
        content = await resp.read()
        return Answer(resp.status, resp.headers, content, sent_at, time.monotonic())
