"""Running one attempt: forward, store what its result means (core/attempts.py), answer the client
(SPEC §2.4, §3.2).

`run_attempt` either finishes the job (stores the response or settles the job, and returns the
client's response), reports that another attempt won the completion CAS (None), or — when the
caller has another upstream to try or another attempt racing — returns `Failed` and leaves the
job alone (SPEC §3.4).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import assert_never

from aiohttp import hdrs, web
from multidict import CIMultiDict
from yarl import URL

from idemproxy.constants import ATTEMPT_HEADER, JOB_HEADER, STREAMING_MEDIA_TYPES
from idemproxy.core.attempts import (
    Handling,
    Mode,
    Outcome,
    checks_contract,
    classify_breach,
    classify_cut_off,
    classify_failure,
    classify_response,
    completes_before_head,
    handed_back,
    response_handling,
    settled_state,
)
from idemproxy.core.resolution import resend_outcome
from idemproxy.core.types import HeaderPairs, Job, StoredResponse
from idemproxy.errors import ProblemError, StoreUnavailable, UpstreamUnavailable
from idemproxy.http.headers import headers_to_store, response_headers_for_client
from idemproxy.http.offload import off_loop
from idemproxy.http.problems import problem_response
from idemproxy.observe.metrics import AttemptOutcome, UpstreamOutcome
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.jobs.lease import KeptLease
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.reasons import FailureReason, upstream_reason
from idemproxy.proxy.routing import upstream_origin
from idemproxy.proxy.server.capture import Captured, answer, capture, tee
from idemproxy.proxy.server.sink import ClientSink
from idemproxy.proxy.server.whole import AsSentStreamResponse
from idemproxy.proxy.upstream.client import UpstreamClient, UpstreamFailure, UpstreamResponse
from idemproxy.proxy.upstream.target import forwarded_headers, outgoing_host, upstream_url

log = logging.getLogger(__name__)
# After forwarding, "the request was not forwarded" (StoreUnavailable's default) would be a lie.
# The outcome is written once the store answers (proxy/background/unwritten.py); if the job's lease
# runs out first, it becomes unknown (SPEC §3.5).
_FORWARDED_NOT_STORED = (
    "The request was forwarded, but its outcome could not be stored; retry later with the same "
    "Idempotency-Key to learn it."
)


@dataclass(frozen=True, slots=True)
class Failed:
    """The attempt ended without a result; the job was not touched."""

    outcome: Outcome
    status: int | None
    error: str | None
    problem: type[ProblemError] = UpstreamUnavailable
    # In a race, the upstream's own answer, for the client if no other attempt does better.
    reply: web.StreamResponse | None = None


@dataclass(frozen=True, slots=True)
class AttemptRun:
    """The attempt this request runs: its job as claimed, its number, its upstream, and its
    place among the job's attempts (core/attempts.py, `Mode`)."""

    job: Job
    number: int
    upstream: str
    mode: Mode = Mode.FINAL
    # SPEC §3.6 (resolve): the request sent again under the key its upstream honours, after an
    # attempt whose outcome is unknown: only a final answer completes the job, anything else
    # leaves it unknown (never released: the earlier attempt may have executed).
    resend: bool = False


Step = web.StreamResponse | Failed | None


async def run_attempt(governed: GovernedRequest, attempt: AttemptRun) -> Step:
    ctx, request = governed.ctx, governed.request
    job = attempt.job
    route = governed.route
    headers = forwarded_headers(
        request,
        ctx.settings.trusted_proxies,
        route.header_edits.get(attempt.upstream, ()),
        host=outgoing_host(route.forward_host, attempt.upstream, request),
    )
    headers[JOB_HEADER] = job.id  # SPEC §10: the backend can honour the same identity
    headers[ATTEMPT_HEADER] = str(attempt.number)
    url = upstream_url(attempt.upstream, request)
    governed.trace.upstream = attempt.upstream
    forwarding = _forward(governed, attempt, url, headers)
    if ctx.tracing is not None:  # its traceparent joins `headers` before they are sent
        ids = (job.id, attempt.number)
        return await ctx.tracing.attempt(request.method, url, headers, ids, forwarding)
    return await forwarding


async def _forward(
    governed: GovernedRequest, attempt: AttemptRun, url: URL, headers: CIMultiDict[str]
) -> Step:
    ctx, request, body = governed.ctx, governed.request, governed.body
    job = attempt.job
    started = time.perf_counter()
    try:
        async with (
            KeptLease(ctx.store, job, lease=ctx.settings.lease),
            ctx.upstream.request(
                request.method,
                url,
                headers,
                body.payload(),
                content_length=body.size,
                timeout=governed.route.upstream_timeout,
            ) as upstream,
        ):
            step = await _on_response(governed, attempt, upstream)
            # Until the upstream's answer was whole, not until it was stored: the store's time
            # is idemproxy_store_seconds' (SPEC §13).
            ended = upstream.finished_at or time.perf_counter()
            _observe_upstream(
                ctx,
                attempt,
                started,
                UpstreamOutcome.FAILED if isinstance(step, Failed) else UpstreamOutcome.ANSWERED,
                ended,
            )
            return step
    except UpstreamFailure as failure:
        outcome, problem = classify_failure(failure.failure)
        if attempt.resend:  # SPEC §3.6 (resolve)
            outcome = resend_outcome(None)
        _observe_upstream(ctx, attempt, started, UpstreamOutcome(outcome.value))
        _log_failure(governed, attempt, failure)
        if ctx.tracing is not None:
            ctx.tracing.upstream_failed(failure.reason, outcome)
        return await _fail(ctx, attempt, Failed(outcome, None, failure.reason, problem))
    except asyncio.CancelledError:
        # Cut off by shutdown: the request may have reached the upstream (SPEC §3.2).
        cut = Failed(classify_cut_off(), None, "cut off by shutdown")
        await asyncio.shield(settle(ctx, attempt, cut))
        raise


async def _on_response(
    governed: GovernedRequest, attempt: AttemptRun, upstream: UpstreamResponse
) -> Step:
    ctx = governed.ctx
    outcome = classify_response(upstream.status, ctx.statuses)
    if attempt.resend:  # SPEC §3.6 (resolve)
        outcome = resend_outcome(upstream.status)
    handling = response_handling(
        outcome,
        attempt.mode,
        event_stream=_is_stream(upstream),
        gated=governed.route.gate is not None,
    )
    match handling:
        case Handling.HAND_BACK:  # the next upstream answers instead: this body is not needed
            return Failed(outcome, upstream.status, None)
        case Handling.HAND_BACK_WITH_REPLY:  # it may be the last answer the race gets
            reply = await _reply(ctx, upstream, attempt)
            return Failed(outcome, upstream.status, None, reply=reply)
        case Handling.STREAM:
            return await _finish_stream(governed, attempt, upstream, outcome)
        case Handling.CAPTURE:
            return await _finish_captured(governed, attempt, upstream, outcome)
        case _:
            assert_never(handling)


async def _finish_captured(
    governed: GovernedRequest, attempt: AttemptRun, upstream: UpstreamResponse, outcome: Outcome
) -> Step:
    ctx, gate = governed.ctx, governed.route.gate
    captured = await _capture(ctx, upstream)
    try:
        if gate is not None and checks_contract(outcome):
            content = await captured.content() if captured.whole else None
            # http/offload.py: a large body is parsed and validated on a worker thread.
            broken = await off_loop(
                content or b"", gate.contract.violations, upstream.status, content
            )
            if broken:
                governed.trace.failed(attempt.upstream, FailureReason.CONTRACT)
                captured.close()
                return await _fail(ctx, attempt, _breach(attempt, upstream.status, broken))
        if captured.whole:
            return await _finish_buffered(governed, attempt, upstream, outcome, captured)
        return await _finish_streamed(governed, attempt, upstream, outcome, captured)
    except BaseException:
        captured.close()
        raise


async def _capture(ctx: ProxyContext, upstream: UpstreamResponse) -> Captured:
    """The body up to max_stored_body, within the response budget (proxy/server/capture.py). A body
    declared larger is not waited for: it streams through at once (SPEC §7)."""
    limit = ctx.settings.max_stored_body
    declared = upstream.content_length
    if declared is not None and declared > limit and upstream.method != "HEAD":
        return Captured(ctx.budget)
    return await capture(upstream, limit, ctx.budget)


def _log_failure(governed: GovernedRequest, attempt: AttemptRun, failure: UpstreamFailure) -> None:
    reason = upstream_reason(failure)
    governed.trace.failed(attempt.upstream, reason)
    log.warning(
        "job %s attempt %d on %s failed (%s): %s",
        attempt.job.id,
        attempt.number,
        upstream_origin(attempt.upstream),
        reason,
        failure.reason,
    )


def _breach(attempt: AttemptRun, status: int, broken: list[str]) -> Failed:
    """SPEC §3.4: the upstream acted, so the breach is unknown, never a release; its response
    is neither stored nor passed on."""
    outcome, problem = classify_breach()
    error = "contract: " + "; ".join(broken)
    log.warning(
        "job %s attempt %d on %s broke the contract (%d): %s",
        attempt.job.id,
        attempt.number,
        attempt.upstream,
        status,
        error,
    )
    return Failed(outcome, status, error, problem)


async def _reply(
    ctx: ProxyContext, upstream: UpstreamResponse, attempt: AttemptRun
) -> web.StreamResponse | None:
    try:
        captured = await capture(upstream, ctx.settings.max_stored_body, ctx.budget)
    except UpstreamFailure:
        return None
    if not captured.whole:
        captured.close()
        return None
    return answer(
        captured, upstream.status, upstream.reason, _client_headers(upstream, attempt.job)
    )


async def _finish_buffered(
    governed: GovernedRequest,
    attempt: AttemptRun,
    upstream: UpstreamResponse,
    outcome: Outcome,
    captured: Captured,
) -> Step:
    ctx = governed.ctx
    # The outcome is stored before the client sees a byte: a client that retries after a lost
    # response always finds it.
    if outcome is Outcome.COMPLETE:
        headers = _stored_headers(ctx, upstream)
        stored = StoredResponse(upstream.status, headers, await captured.content())
        ctx.failpoints.hit("before_store")
        if not await completed(ctx, attempt, stored, governed.route.ttl):
            captured.close()
            return None
        ctx.failpoints.hit("after_store")
    else:
        await settle(ctx, attempt, Failed(outcome, upstream.status, None))
    return answer(
        captured, upstream.status, upstream.reason, _client_headers(upstream, attempt.job)
    )


async def _finish_streamed(
    governed: GovernedRequest,
    attempt: AttemptRun,
    upstream: UpstreamResponse,
    outcome: Outcome,
    head: Captured,
) -> Step:
    """SPEC §7: a body over max_stored_body streams through in full and is not kept.

    In a race (hedging) the attempt must win before a byte reaches the client, so it completes
    first, as "omitted"; a body cut off after that leaves the job completed, not unknown.
    """
    ctx, ttl = governed.ctx, governed.route.ttl
    omitted = StoredResponse(upstream.status, _stored_headers(ctx, upstream), None)
    racing = completes_before_head(outcome, attempt.mode)
    if racing and not await completed(ctx, attempt, omitted, ttl):
        return None
    response = AsSentStreamResponse(status=upstream.status, reason=upstream.reason)
    response.headers.extend(_client_headers(upstream, attempt.job))
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    client = ClientSink(governed.request, response)
    await client.write(b"")  # the head goes out now, not with the first byte of the body
    async for piece in head.pieces():
        await client.write(piece)
    head.close()
    try:
        async for chunk in UpstreamClient.iter_body(upstream):
            await client.write(chunk)
    except UpstreamFailure as failure:
        if not racing:
            cut = Failed(classify_cut_off(), upstream.status, failure.reason)
            await _after_head(attempt, settle(ctx, attempt, cut))
        client.abort()
        return response
    if outcome is Outcome.COMPLETE:
        if not racing:
            await _after_head(attempt, completed(ctx, attempt, omitted, ttl))
    else:
        failed = Failed(outcome, upstream.status, None)
        await _after_head(attempt, settle(ctx, attempt, failed))
    await client.finish()
    return response


def _is_stream(upstream: UpstreamResponse) -> bool:
    media_type = upstream.headers.get("Content-Type", "").partition(";")[0]
    return media_type.strip().lower() in STREAMING_MEDIA_TYPES


async def _finish_stream(
    governed: GovernedRequest, attempt: AttemptRun, upstream: UpstreamResponse, outcome: Outcome
) -> Step:
    """SPEC §2 step 4: a stream of events (server-sent events, NDJSON) reaches its client as it
    arrives and is stored once it has ended (without its body when over max_stored_body). A
    duplicate meanwhile is held, and gets the replay. Not in a race, whose winner must be
    decided before a byte goes out, and not behind a contract gate, which needs the whole body.
    """
    ctx = governed.ctx
    response = AsSentStreamResponse(status=upstream.status, reason=upstream.reason)
    response.headers.extend(_client_headers(upstream, attempt.job))
    client = ClientSink(governed.request, response)
    await client.write(b"")  # the head goes out now
    try:
        kept = await tee(upstream, client, ctx.settings.max_stored_body, ctx.budget)
    except UpstreamFailure as failure:
        cut = Failed(classify_cut_off(), upstream.status, failure.reason)
        await _after_head(attempt, settle(ctx, attempt, cut))
        client.abort()
        return response
    try:
        if outcome is Outcome.COMPLETE:
            headers = _stored_headers(ctx, upstream)
            body = await kept.content() if kept.whole else None
            stored = StoredResponse(upstream.status, headers, body)
            await _after_head(attempt, completed(ctx, attempt, stored, governed.route.ttl))
        else:
            await _after_head(attempt, settle(ctx, attempt, Failed(outcome, upstream.status, None)))
    finally:
        kept.close()
    await client.finish()
    return response


async def _after_head(attempt: AttemptRun, storing: Awaitable[object]) -> None:
    """Store an outcome whose response is on its way to the client already (SPEC §7: one
    response per request).

    A StoreUnavailable must not reach the handler: its 503 would follow the response on the
    same connection, and the next request on it (behind a pooling load balancer, maybe another
    client's) would read it as its answer. `completed` and `settle` kept the outcome, and
    proxy/background/unwritten.py writes it once the store answers.
    """
    try:
        await storing
    except StoreUnavailable:
        log.warning(
            "job %s attempt %d: outcome not stored after its response started; "
            "kept to write when the store answers",
            attempt.job.id,
            attempt.number,
        )


async def _fail(ctx: ProxyContext, attempt: AttemptRun, failed: Failed) -> Step:
    """A failed attempt: the caller's to handle, or, on the last option, the job's end."""
    if handed_back(failed.outcome, attempt.mode):
        return failed
    await settle(ctx, attempt, failed)
    problem = failed.problem().about(attempt.job.id, settled_state(failed.outcome).value)
    return problem_response(problem, profile=ctx.settings.profile, types=ctx.settings.problem_types)


async def completed(
    ctx: ProxyContext, attempt: AttemptRun, stored: StoredResponse, ttl: float
) -> bool:
    """The completion CAS (SPEC §1); a losing result is discarded, counted and logged."""
    completing = ctx.store.complete(attempt.job, attempt.number, stored, ttl=ttl)
    if ctx.tracing is not None:
        completing = ctx.tracing.complete(attempt.job.id, attempt.number, completing)
    try:
        won = await completing
    except StoreUnavailable as exc:
        ctx.unwritten.completion(attempt.job, attempt.number, stored, ttl)
        raise StoreUnavailable(_FORWARDED_NOT_STORED) from exc
    ctx.metrics.attempt_outcome[AttemptOutcome.SUCCEEDED if won else AttemptOutcome.DISCARDED].inc()
    if not won:
        ctx.metrics.late_results.inc()
        log.info("late result discarded: job %s attempt %d", attempt.job.id, attempt.number)
    return won


def count_failed(ctx: ProxyContext, failed: Failed) -> None:
    ctx.metrics.attempt_outcome[
        AttemptOutcome.FAILED if failed.outcome is Outcome.RELEASE else AttemptOutcome.UNKNOWN
    ].inc()


def _observe_upstream(
    ctx: ProxyContext,
    attempt: AttemptRun,
    started: float,
    outcome: UpstreamOutcome,
    ended: float | None = None,
) -> None:
    finished = time.perf_counter() if ended is None else ended
    by_outcome = ctx.metrics.upstream_call[upstream_origin(attempt.upstream)]
    by_outcome[outcome].observe(finished - started)


async def settle(ctx: ProxyContext, attempt: AttemptRun, failed: Failed) -> None:
    count_failed(ctx, failed)
    state = settled_state(failed.outcome)
    settling = ctx.store.settle(
        attempt.job, attempt.number, state, status=failed.status, error=failed.error
    )
    if ctx.tracing is not None:
        settling = ctx.tracing.settle(attempt.job.id, attempt.number, state, settling)
    try:
        won = await settling
    except StoreUnavailable as exc:
        ctx.unwritten.settlement(attempt.job, attempt.number, state, failed.status, failed.error)
        raise StoreUnavailable(_FORWARDED_NOT_STORED) from exc
    if not won:
        log.info("job %s attempt %d: settle lost the CAS", attempt.job.id, attempt.number)


def _client_headers(upstream: UpstreamResponse, job: Job) -> CIMultiDict[str]:
    headers = response_headers_for_client(upstream.headers)
    headers.extend(_head_length(upstream))
    headers[JOB_HEADER] = job.id
    return headers


def _stored_headers(ctx: ProxyContext, upstream: UpstreamResponse) -> HeaderPairs:
    return headers_to_store(upstream.headers, ctx.settings.unreplayed_headers) + _head_length(
        upstream
    )


def _head_length(upstream: UpstreamResponse) -> HeaderPairs:
    """RFC 9110 §9.3.2, §8.6: a HEAD answer's Content-Length is that of the body a GET would
    get, not of its own (it has none), so it is not recomputed as every other one is (SPEC §7):
    the upstream's, for the first answer and, stored, for each replay."""
    if upstream.method == "HEAD" and upstream.content_length is not None:
        return ((hdrs.CONTENT_LENGTH, str(upstream.content_length)),)
    return ()
