"""Sending one item: the request, its retries under the same key, and its result record (SPEC §14).

aiohttp errors are translated here and nowhere else (STYLE §4): every transport failure — refused,
reset, cut off, timed out — is transient, because the retry carries the same key.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict

from idemproxy.batch.input import Item
from idemproxy.batch.keys import Identity
from idemproxy.batch.outcome import Verdict, classify, next_delay, retry_after_seconds
from idemproxy.batch.records import Outcome, ResultRecord, encode_body, utc_now
from idemproxy.constants import ERROR_HEADER, REPLAYED_HEADER

Sleep = Callable[[float], Awaitable[None]]

_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


@dataclass(frozen=True)
class RetryPolicy:
    retries: int
    timeout: float
    backoff_base: float
    backoff_max: float


@dataclass(frozen=True)
class Request:
    """An item ready to send: where, with which headers (the key among them) and which bytes."""

    item: Item
    identity: Identity
    url: str
    headers: Mapping[str, str]
    data: bytes | None


@dataclass(frozen=True)
class Answer:
    status: int
    error_code: str | None
    replayed: bool
    retry_after: float | None
    content_type: str | None
    body: bytes


@dataclass
class _Tries:
    started_at: str
    count: int = 0
    answer: Answer | None = None
    error: str | None = None


def build_request(
    item: Item, identity: Identity, target: str, headers: Mapping[str, str], key_header: str
) -> Request:
    data, content_type = item.payload()
    merged: CIMultiDict[str] = CIMultiDict(headers)
    for name, value in item.headers:
        merged[name] = value  # an item's own header beats the run's, case-insensitively
    merged[key_header] = identity.key
    if content_type is not None:
        merged["Content-Type"] = content_type
    return Request(item, identity, target.rstrip("/") + item.path, merged, data)


async def send(
    session: aiohttp.ClientSession,
    request: Request,
    policy: RetryPolicy,
    *,
    sleep: Sleep = asyncio.sleep,
    rng: random.Random | None = None,
) -> ResultRecord:
    """Send until a final answer or until the retries run out; never raises for the network."""
    tries = _Tries(utc_now())
    while True:
        tries.count += 1
        verdict = await _try_once(session, request, policy.timeout, tries)
        if verdict is not Verdict.RETRY:
            return _record(request, tries, verdict)
        if tries.count > policy.retries:
            return _record(request, tries, Verdict.FAILED, retryable=True)
        retry_after = tries.answer.retry_after if tries.answer else None
        await sleep(
            next_delay(tries.count, retry_after, policy.backoff_base, policy.backoff_max, rng)
        )


async def _try_once(
    session: aiohttp.ClientSession, request: Request, timeout: float, tries: _Tries
) -> Verdict:
    try:
        answer = await _exchange(session, request, timeout)
    except _TRANSPORT_ERRORS as exc:
        tries.answer, tries.error = None, _describe(exc)
        return Verdict.RETRY
    tries.answer, tries.error = answer, None
    return classify(answer.status, answer.error_code)


def _text(value: str | None) -> str | None:
    """A header value as text a result line can hold (SPEC §14: strict JSON, UTF-8). aiohttp
    decodes a byte that is not UTF-8 (obs-text, RFC 9110 §5.5) as a lone surrogate, which no
    UTF-8 file takes; it is recorded as U+FFFD."""
    if value is None or value.isascii():
        return value
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


async def _exchange(session: aiohttp.ClientSession, request: Request, timeout: float) -> Answer:
    async with session.request(
        request.item.method,
        request.url,
        data=request.data,
        headers=request.headers,
        allow_redirects=False,
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as response:
        body = await response.read()
        return Answer(
            status=response.status,
            error_code=_text(response.headers.get(ERROR_HEADER)),
            replayed=response.headers.get(REPLAYED_HEADER, "").lower() == "true",
            retry_after=retry_after_seconds(response.headers.get("Retry-After")),
            content_type=_text(response.headers.get("Content-Type")),
            body=body,
        )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout: no complete answer in time"
    detail = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {detail}"


def _record(
    request: Request, tries: _Tries, verdict: Verdict, *, retryable: bool = False
) -> ResultRecord:
    answer = tries.answer
    body, encoding = encode_body(answer.body, answer.content_type) if answer else (None, "none")
    outcome = {Verdict.DONE: Outcome.DONE, Verdict.UNKNOWN: Outcome.UNKNOWN}.get(
        verdict, Outcome.FAILED
    )
    return ResultRecord(
        id=request.item.id,
        outcome=outcome,
        status=answer.status if answer else None,
        replayed=answer.replayed if answer else False,
        attempts=tries.count,
        body=body,
        body_encoding=encoding,
        content_type=answer.content_type if answer else None,
        error=tries.error,
        error_code=answer.error_code if answer else None,
        retryable=retryable,
        key=request.identity.key,
        request_hash=request.identity.request_hash,
        meta=request.item.meta,
        started_at=tries.started_at,
        finished_at=utc_now(),
    )
