"""The short loop around the decision core for requests with a key (SPEC §2.2-§2.4).

Each turn does one I/O step (claim, wait, CAS, re-read) and feeds the result back to `decide`.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from idemproxy.constants import WAITER_RECHECK_SECONDS
from idemproxy.decision import (
    Forget,
    Hold,
    Reject,
    Replay,
    StartNextAttempt,
    TakeOver,
    decide,
)
from idemproxy.errors import RequestInFlight, StoreUnavailable, TooManyWaiters
from idemproxy.ids import new_job_id
from idemproxy.proxy.body import RequestBody
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.jobrun import run_job
from idemproxy.proxy.passthrough import passthrough
from idemproxy.proxy.replay import replay_response
from idemproxy.proxy.routing import Route
from idemproxy.proxy.trace import Trace
from idemproxy.types import Claimed, ClaimResult, Existing, Intent, Job, JobState

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
    for _ in range(_MAX_TURNS):
        if isinstance(result, Claimed):
            trace.ran(result.job.id, result.attempt)
            ctx.failpoints.hit("after_claim")
            response = await run_shielded(ctx, request, route, result, body)
            if response is not None:
                return response
            result = await _reread(ctx, route, intent)  # lost the CAS: answer with the winner
            continue
        job = result.job
        decision = decide(job, intent.fingerprint, ctx.policy, wait_expired=loop.time() >= deadline)
        if isinstance(decision, Replay):
            trace.replayed(job.id)
            return replay_response(job.id, decision.response, ctx.replays)
        if isinstance(decision, Reject):
            raise decision.problem()
        if isinstance(decision, Hold):
            trace.held = True
            result = await _hold(ctx, route, intent, job, deadline)
        elif isinstance(decision, StartNextAttempt):
            claimed = await ctx.store.start_next_attempt(
                job, route.upstream, lease=ctx.settings.lease
            )
            result = claimed or await _reread(ctx, route, intent)
        elif isinstance(decision, TakeOver):
            await ctx.store.take_over(job)  # winners and losers alike re-read the job
            result = await _reread(ctx, route, intent)
        elif isinstance(decision, Forget):
            await ctx.store.forget(job)
            result = await _claim(ctx, route, intent)
    raise RequestInFlight()


async def run_shielded(
    ctx: ProxyContext, request: web.Request, route: Route, claimed: Claimed, body: RequestBody
) -> web.StreamResponse | None:
    """SPEC §2: the client disconnecting must not cancel the upstream call or the completion."""
    task = asyncio.create_task(run_job(ctx, request, route, claimed, body))
    ctx.attempts.add(task)
    task.add_done_callback(ctx.attempts.discard)
    return await asyncio.shield(task)


async def _claim(
    ctx: ProxyContext, route: Route, intent: Intent, *, forwarded_if_failed: bool = False
) -> ClaimResult:
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


async def _reread(ctx: ProxyContext, route: Route, intent: Intent) -> ClaimResult:
    job = await ctx.store.get(intent.owner, intent.key)
    return Existing(job) if job is not None else await _claim(ctx, route, intent)


async def _hold(
    ctx: ProxyContext, route: Route, intent: Intent, job: Job, deadline: float
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
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            await subscription.wait(min(remaining, WAITER_RECHECK_SECONDS))
            current = await ctx.store.get(intent.owner, intent.key)
    return Existing(current) if current is not None else await _claim(ctx, route, intent)


def _still_running(current: Job | None, job: Job) -> bool:
    return (
        current is not None
        and current.id == job.id
        and current.state is JobState.IN_FLIGHT
        and not current.lease_expired
    )
