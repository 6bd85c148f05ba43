"""The short loop around the decision core for requests with a key (SPEC §2.2-§2.4).

Each turn does one I/O step (claim, wait, CAS, re-read) and feeds the result back to `decide`.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from idemproxy.constants import WAITER_RECHECK_SECONDS
from idemproxy.core.decision import (
    Forget,
    Hold,
    Reject,
    Replay,
    StartNextAttempt,
    TakeOver,
    decide,
)
from idemproxy.core.types import Claimed, ClaimResult, Existing, Intent, Job, JobState
from idemproxy.errors import (
    JobLost,
    RequestInFlight,
    ShuttingDown,
    StoreUnavailable,
    TooManyWaiters,
    UpstreamTimeout,
)
from idemproxy.identity.ids import new_job_id
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.jobs.jobrun import run_job
from idemproxy.proxy.passthrough import passthrough
from idemproxy.proxy.routing import Route
from idemproxy.proxy.server.body import RequestBody
from idemproxy.proxy.server.capture import drop_unsent
from idemproxy.proxy.server.replay import replay_response
from idemproxy.proxy.server.trace import Trace

log = logging.getLogger(__name__)
_CUT_OFF = (
    "The proxy shut down before the upstream answered; the request may have executed. Retries "
    "with this Idempotency-Key get 409 outcome-unknown until an operator resolves the job."
)
_HELD_AT_SHUTDOWN = (
    "The proxy is shutting down; the request with this key is still in flight. Retry with the "
    "same Idempotency-Key to get its result."
)
# Every turn makes progress (a state changed or time passed); this only guards against a bug.
_MAX_TURNS = 32


async def handle_governed(
    ctx: ProxyContext,
    request: web.Request,
    route: Route,
    intent: Intent,
    body: RequestBody,
    trace: Trace,
) -> web.StreamResponse:
    passes_through = ctx.settings.on_store_error == "passthrough"  # SPEC §11: explicit opt-out
    try:
        result = await _claim(ctx, route, intent, forwarded_if_failed=passes_through)
    except StoreUnavailable:
        if passes_through:
            return await passthrough(ctx, request, route, body)
        raise
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ctx.settings.effective_max_wait
    # The job this request ran an attempt of, once that attempt lost its CAS: from then on the
    # request only answers from that job, and never claims or starts an attempt again (one
    # request, at most one execution).
    ran: str | None = None
    for _ in range(_MAX_TURNS):
        if isinstance(result, Claimed):
            trace.ran(result.job.id, result.attempt)
            ctx.failpoints.hit("after_claim")
            response = await run_shielded(ctx, request, route, result, body)
            if response is not None:
                return response
            ran = result.job.id
            result = await _reread(ctx, route, intent, ran)  # lost the CAS: the winner's answer
            continue
        job = result.job
        _check_own(job, ran)
        decision = decide(job, intent.fingerprint, ctx.policy, wait_expired=loop.time() >= deadline)
        if isinstance(decision, Replay):
            trace.replayed(job.id)
            return replay_response(job.id, decision.response, ctx.replays)
        if isinstance(decision, Reject):
            raise decision.problem()
        if isinstance(decision, Hold):
            trace.held = True
        result = await _act(ctx, route, intent, job, decision, deadline, ran)
    raise RequestInFlight()


async def _act(
    ctx: ProxyContext,
    route: Route,
    intent: Intent,
    job: Job,
    decision: Hold | StartNextAttempt | TakeOver | Forget,
    deadline: float,
    ran: str | None,
) -> ClaimResult:
    """One I/O step for a decision that does not answer the client yet."""
    if isinstance(decision, Hold):
        return await _hold(ctx, route, intent, job, deadline, ran)
    if isinstance(decision, TakeOver):
        await ctx.store.take_over(job)  # winners and losers alike re-read the job
        return await _reread(ctx, route, intent, ran)
    if ran is not None:
        # Released (an operator resolved the job taken over from under this attempt) or
        # expired: running it again would be this request's second execution.
        raise _lost(job.id, f"it is {job.state.value} again")
    if isinstance(decision, StartNextAttempt):
        _refuse_if_draining(ctx)
        claimed = await ctx.store.start_next_attempt(job, route.upstream, lease=ctx.settings.lease)
        return claimed or await _reread(ctx, route, intent, ran)
    await ctx.store.forget(job)
    return await _claim(ctx, route, intent)


def _check_own(job: Job, ran: str | None) -> None:
    """After its attempt lost the CAS, a request answers only from its own job: another one
    under the key means an operator deleted this one (and a retry claimed the key afresh)."""
    if ran is not None and job.id != ran:
        raise _lost(ran, f"job {job.id} holds its key now")


async def run_shielded(
    ctx: ProxyContext, request: web.Request, route: Route, claimed: Claimed, body: RequestBody
) -> web.StreamResponse | None:
    """SPEC §2: the client disconnecting must not cancel the upstream call or the completion."""
    task = asyncio.create_task(run_job(ctx, request, route, claimed, body))
    ctx.attempts.add(task)
    task.add_done_callback(ctx.attempts.discard)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not _cut_off_by_shutdown(task, request):
            # The client left: the attempt goes on, and its response is never sent.
            task.add_done_callback(_drop_result)
            raise
    # SPEC §3.2: the drain's deadline cancelled the attempt and its job is unknown. The first
    # client gets a 504 as for any attempt whose outcome is unknown, not a bare disconnect
    # (unless the response had already started); retries get 409 outcome-unknown.
    raise UpstreamTimeout(_CUT_OFF)


def _drop_result(task: asyncio.Task[web.StreamResponse | None]) -> None:
    if not task.cancelled() and task.exception() is None:
        drop_unsent(task.result())


def _cut_off_by_shutdown(
    task: asyncio.Task[web.StreamResponse | None], request: web.Request
) -> bool:
    this = asyncio.current_task()
    return (
        task.cancelled()
        and (this is None or not this.cancelling())
        and request.writer.output_size == 0
    )


def _refuse_if_draining(ctx: ProxyContext) -> None:
    """SPEC §8: once a shutdown began, nothing new is claimed: an attempt started now could be
    cut off as `unknown` at the drain's deadline."""
    if ctx.draining:
        raise ShuttingDown()


async def _claim(
    ctx: ProxyContext, route: Route, intent: Intent, *, forwarded_if_failed: bool = False
) -> ClaimResult:
    _refuse_if_draining(ctx)
    job_id = new_job_id()
    try:
        return await ctx.store.claim(
            intent, job_id, route.upstream, ttl=route.ttl, lease=ctx.settings.lease
        )
    except StoreUnavailable:
        # The store may still commit it (a stalled server): a job nobody runs. Unless the
        # request goes upstream anyway, nothing was forwarded under it, so it may be released.
        if not forwarded_if_failed:
            ctx.unsent.note(intent.owner, intent.key, job_id)
        raise


async def _reread(
    ctx: ProxyContext, route: Route, intent: Intent, ran: str | None = None
) -> ClaimResult:
    job = await ctx.store.get(intent.owner, intent.key)
    return Existing(job) if job is not None else await _claim_unless_ran(ctx, route, intent, ran)


async def _claim_unless_ran(
    ctx: ProxyContext, route: Route, intent: Intent, ran: str | None
) -> ClaimResult:
    """No job under the key: claim it afresh, unless this request already ran an attempt of
    the job that was there (an operator deleted it under that attempt, whose outcome could not
    be stored): a claim now would execute the request a second time."""
    if ran is not None:
        raise _lost(ran, "it was deleted")
    return await _claim(ctx, route, intent)


def _lost(job_id: str, why: str) -> JobLost:
    log.warning(
        "job %s: its attempt's outcome could not be stored (%s); answered 409, not run again",
        job_id,
        why,
    )
    return JobLost()


async def _hold(
    ctx: ProxyContext, route: Route, intent: Intent, job: Job, deadline: float, ran: str | None
) -> ClaimResult:
    """Wait, without a pooled connection, until the job leaves in_flight or the deadline passes."""
    watch = ctx.store.watch
    if (
        watch.waiting_for(job.id) >= ctx.settings.max_waiters_per_key
        or watch.waiting >= ctx.settings.max_waiters
    ):
        raise TooManyWaiters()
    loop = asyncio.get_running_loop()
    async with ctx.store.watching(job.id) as subscription:
        # Re-read after subscribing, so that a change just before it cannot be missed.
        current = await ctx.store.watch_job(intent.owner, intent.key)
        while _still_running(current, job):
            if ctx.draining:  # SPEC §8: an answer now, not a disconnect at the drain's end
                raise ShuttingDown(_HELD_AT_SHUTDOWN)
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            await subscription.wait(min(remaining, WAITER_RECHECK_SECONDS))
            current = await ctx.store.get(intent.owner, intent.key)
    if current is not None:
        return Existing(current)
    return await _claim_unless_ran(ctx, route, intent, ran)


def _still_running(current: Job | None, job: Job) -> bool:
    return (
        current is not None
        and current.id == job.id
        and current.state is JobState.IN_FLIGHT
        and not current.lease_expired
    )
