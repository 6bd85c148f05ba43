"""Sending one item: the request, its retries under the same key, and its result record (SPEC §14).

aiohttp errors are translated here and nowhere else: every transport failure — refused,
reset, cut off, timed out — is transient, because the retry carries the same key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from multidict import CIMultiDict

from idemproxy.batch.input import Item
from idemproxy.batch.keys import Identity
from idemproxy.batch.outcome import (
    Verdict,
    classify,
    may_have_executed,
    next_delay,
    problem_standing,
    retry_after_seconds,
    settles,
)
from idemproxy.batch.ratelimit import RATE_LIMITED_STATUSES, pause_seconds
from idemproxy.batch.records import Outcome, ResultRecord, encode_body, utc_now, valid_text
from idemproxy.batch.usage import WorstCase, worst_case
from idemproxy.constants import ERROR_HEADER, REPLAY_OMITTED_HEADER, REPLAYED_HEADER

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
    key_header: str
    # Written on its line if it may have executed with no answer; None: from its request alone.
    worst_case: WorstCase | None = None
    # An earlier run of this batch sent it and had no answer (its line has a `worst_case`).
    sent_before: bool = False

    def worst_case_json(self) -> dict[str, Any]:
        return (self.worst_case or worst_case(self.item, None)).to_json()


@dataclass(frozen=True)
class Answer:
    status: int
    error_code: str | None
    replayed: bool
    omitted: bool  # SPEC §7: a replay without the body the proxy did not store
    retry_after: float | None
    content_type: str | None
    body: bytes
    # A 429 or 503: how long the answer asks every client to wait (ratelimit.py), else None.
    rate_limit_pause: float | None = None
    # The `retry` member of the proxy's own problem document (SPEC §8), else None.
    advice: str | None = None
    # Its `job_state` member (SPEC §8), else None.
    job_state: str | None = None

    @property
    def rate_limited(self) -> bool:
        return self.status in RATE_LIMITED_STATUSES and not self.replayed


class AttemptGate(Protocol):
    """What a run's shared rate limits see of one item's attempts (runner.py)."""

    async def before_retry(self) -> bool:
        """Wait until a retry may go; False when the run was stopped meanwhile."""
        ...

    def after(self, answer: Answer | None) -> None:
        """An attempt ended, with this answer (None: no answer came)."""
        ...


@dataclass
class _Tries:
    started_at: str
    count: int = 0
    answer: Answer | None = None
    error: str | None = None
    # A try was sent and no answer said what it did: the item may have executed (SPEC §3.2).
    unanswered: bool = False
    settled: bool = False  # the last answer is the execution's own (or its replay)


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
    return Request(item, identity, target.rstrip("/") + item.path, merged, data, key_header)


async def send(
    session: aiohttp.ClientSession,
    request: Request,
    policy: RetryPolicy,
    *,
    stop: asyncio.Event | None = None,
    gate: AttemptGate | None = None,
) -> ResultRecord:
    """Send until a final answer or until the retries run out; never raises for the network.

    `stop` set (the first Ctrl-C) ends a backoff at once: the item is recorded `failed` and
    retryable, so the next run asks again under the same key (SPEC §14: a clean stop). The
    first attempt is the caller's to admit; `gate` admits each retry and sees every answer.
    """
    tries = _Tries(utc_now())
    while True:
        tries.count += 1
        verdict = await _try_once(session, request, policy.timeout, tries)
        if gate is not None:
            gate.after(tries.answer)
        if verdict is not Verdict.RETRY:
            return _record(request, tries, verdict)
        if tries.count > policy.retries:
            return _record(request, tries, Verdict.FAILED, retryable=True)
        retry_after = tries.answer.retry_after if tries.answer else None
        delay = next_delay(tries.count, retry_after, policy.backoff_base, policy.backoff_max)
        if await _stopped_during(asyncio.sleep(delay), stop):
            return _record(request, tries, Verdict.FAILED, retryable=True)
        if gate is not None and not await gate.before_retry():
            return _record(request, tries, Verdict.FAILED, retryable=True)


async def _stopped_during(backoff: Awaitable[None], stop: asyncio.Event | None) -> bool:
    """Wait out the backoff unless `stop` is set first; whether it was."""
    if stop is None:
        await backoff
        return False
    if stop.is_set():
        return True
    waiting = asyncio.ensure_future(backoff)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiting, stopping):
            task.cancel()
        await asyncio.gather(waiting, stopping, return_exceptions=True)
    return stop.is_set()


async def _try_once(
    session: aiohttp.ClientSession, request: Request, timeout: float, tries: _Tries
) -> Verdict:
    try:
        answer = await _exchange(session, request, timeout)
    except _TRANSPORT_ERRORS as exc:
        tries.answer, tries.error, tries.settled = None, _describe(exc), False
        # A refused connection sent nothing; after anything else the request may have reached
        # the upstream and executed.
        tries.unanswered |= not isinstance(exc, aiohttp.ClientConnectorError)
        return Verdict.RETRY
    tries.answer, tries.error = answer, None
    verdict = classify(
        answer.status,
        answer.error_code,
        replayed=answer.replayed,
        omitted=answer.omitted,
        advice=answer.advice,
    )
    tries.unanswered |= may_have_executed(
        answer.status, answer.error_code, verdict, answer.job_state
    )
    tries.settled = settles(answer.error_code, verdict)
    return verdict


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
        headers = response.headers
        limited = response.status in RATE_LIMITED_STATUSES
        error_code = valid_text(headers.get(ERROR_HEADER))
        advice, job_state = problem_standing(body) if error_code is not None else (None, None)
        # aiohttp keeps undecodable header bytes as lone surrogates: made valid text here, so
        # that whatever the upstream sent, the record can be written (records.py).
        return Answer(
            status=response.status,
            error_code=error_code,
            replayed=headers.get(REPLAYED_HEADER, "").strip().lower() == "true",
            omitted=headers.get(REPLAY_OMITTED_HEADER, "").strip().lower() == "omitted",
            retry_after=retry_after_seconds(headers.get("Retry-After")),
            content_type=valid_text(headers.get("Content-Type")),
            body=body,
            rate_limit_pause=pause_seconds(headers) if limited else None,
            advice=advice,
            job_state=job_state,
        )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout: no complete answer in time"
    detail = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {valid_text(detail)}"


_OUTCOMES = {
    Verdict.DONE: Outcome.DONE,
    Verdict.UNKNOWN: Outcome.UNKNOWN,
    Verdict.OMITTED: Outcome.OMITTED,
}
# SPEC §7: written in the record's `error`, so that the results file alone says what happened.
OMITTED_ERROR = (
    "executed once, but the proxy did not store the answer (larger than its max_stored_body) "
    "and replays it without its body; a rerun cannot get it back"
)


def _record(
    request: Request, tries: _Tries, verdict: Verdict, *, retryable: bool = False
) -> ResultRecord:
    answer = tries.answer
    body, encoding = encode_body(answer.body, answer.content_type) if answer else (None, "none")
    outcome = _OUTCOMES.get(verdict, Outcome.FAILED)
    error = OMITTED_ERROR if outcome is Outcome.OMITTED else tries.error
    # SPEC §14: a try of this batch was sent and not answered (here or in an earlier run). Until
    # an answer of the execution comes, it may have been paid: its worst case is written, and
    # counted. The answer that comes is this batch's own execution, even when it is a replay.
    own = tries.unanswered or request.sent_before
    in_doubt = own and not tries.settled
    return ResultRecord(
        id=request.item.id,
        outcome=outcome,
        status=answer.status if answer else None,
        replayed=answer.replayed if answer else False,
        attempts=tries.count,
        body=body,
        body_encoding=encoding,
        content_type=answer.content_type if answer else None,
        error=error,
        error_code=answer.error_code if answer else None,
        retryable=retryable,
        key=request.identity.key,
        request_hash=request.identity.request_hash,
        meta=request.item.meta,
        started_at=tries.started_at,
        finished_at=utc_now(),
        key_header=request.key_header,
        worst_case=request.worst_case_json() if in_doubt else None,
        sent_before=own and tries.settled and answer is not None and answer.replayed,
    )


def failed_record(request: Request, started_at: str, exc: Exception) -> ResultRecord:
    """The record of an item whose answer could not be turned into a result line.

    A bug of ours or an answer nothing here foresaw: this item is `failed` (not retryable; a
    rerun with --retry-failed asks again under the same key, and the proxy replays), and the
    batch goes on instead of dying at the same item on every resume.
    """
    return ResultRecord(
        id=request.item.id,
        outcome=Outcome.FAILED,
        status=None,
        replayed=False,
        attempts=0,
        body=None,
        body_encoding="none",
        content_type=None,
        error=f"the answer could not be recorded: {_describe(exc)}",
        error_code=None,
        retryable=False,
        key=request.identity.key,
        request_hash=request.identity.request_hash,
        meta=request.item.meta,
        started_at=started_at,
        finished_at=utc_now(),
        key_header=request.key_header,
        # The request went out, and what its answer says it used is not known.
        worst_case=request.worst_case_json(),
    )
