"""The short loop around the decision core for requests with a key (SPEC §2.2-§2.4).

Each turn does one I/O step (claim, wait, CAS, re-read) and feeds the result back to `decide`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import assert_never

from aiohttp import web

from idemproxy.constants import WAITER_RECHECK_SECONDS
from idemproxy.core.decision import (
    AskAbout,
    Forget,
    Hold,
    Reject,
    Replay,
    StartNextAttempt,
    TakeOver,
    decide,
)
from idemproxy.core.quota import IN_FLIGHT, RATE, STORED_BYTES, QuotaLimits, retry_after
from idemproxy.core.states import EXPIRABLE
from idemproxy.core.types import Claimed, ClaimResult, Existing, Job, JobState
from idemproxy.errors import (
    JobLost,
    ProblemError,
    QuotaExceeded,
    RequestInFlight,
    ShuttingDown,
    StoreUnavailable,
    TooManyWaiters,
    UpstreamTimeout,
)
from idemproxy.identity.ids import new_job_id
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.jobs.unknown import RetryQuestion, run_claimed
from idemproxy.proxy.server.capture import drop_unsent
from idemproxy.proxy.server.fit import fitted, unfit
from idemproxy.proxy.server.replay import replay_response

log = logging.getLogger(__name__)
_CUT_OFF = (
    "The proxy shut down before the upstream answered; the request may have executed. Retries "
    "with this Idempotency-Key get 409 outcome-unknown until an operator resolves the job."
)
_HELD_AT_SHUTDOWN = (
    "The proxy is shutting down; the request with this key is still in flight. Retry with the "
    "same Idempotency-Key to get its result."
)
_QUOTA_DETAIL = {
    IN_FLIGHT: "This owner has as many requests in flight as its quota allows; nothing was "
    "claimed or forwarded. Retry with the same Idempotency-Key after Retry-After.",
    RATE: "This owner started as many new requests this second as its quota allows; nothing "
    "was claimed or forwarded. Retry with the same Idempotency-Key after Retry-After.",
    STORED_BYTES: "This owner's stored responses fill its quota; nothing was claimed or "
    "forwarded. Retry with the same Idempotency-Key after Retry-After.",
}
# Every turn makes progress (a state changed or time passed); this only guards against a bug.
_MAX_TURNS = 32


async def handle_governed(governed: GovernedRequest) -> web.StreamResponse | None:
    """The answer to a governed request, or None when the store could not take its claim and
    the settings say to forward it ungoverned then (`on_store_error: passthrough`, SPEC §11):
    the caller passes it through. Nothing was claimed, so nothing can run twice."""
    ctx = governed.ctx
    passes_through = ctx.settings.on_store_error == "passthrough"  # SPEC §11: explicit opt-out
    try:
        result = await _claim(governed, forwarded_if_failed=passes_through)
    except StoreUnavailable:
        if passes_through:
            return None
        raise
    loop = asyncio.get_running_loop()
    deadline = loop.time() + governed.route.max_wait
    seen = _Seen(result.job)
    try:
        return await _turns(governed, result, deadline, seen)
    except ProblemError as problem:
        # SPEC §8: the answer names the job it is about and the state it was last read in.
        problem.about(seen.ran or seen.job.id, seen.job.state.value)
        raise


class _Seen:
    """The job a governed request last read, and the one it ran an attempt of once that
    attempt lost its CAS: from then on the request only answers from that job, and never claims
    or starts an attempt again (one request, at most one execution)."""

    __slots__ = ("job", "question", "ran")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.ran: str | None = None
        # SPEC §3.6 (resolve): this request's one question about an unknown job.
        self.question = RetryQuestion()


async def _turns(
    governed: GovernedRequest, result: ClaimResult, deadline: float, seen: _Seen
) -> web.StreamResponse:
    ctx = governed.ctx
    loop = asyncio.get_running_loop()
    for _ in range(_MAX_TURNS):
        seen.job = result.job
        if governed.transition is not None:  # SPEC §5: the job may be under the legacy owner
            governed = _in_scope(governed, result.job.owner)
        if isinstance(result, Claimed):
            governed.trace.ran(result.job.id, result.attempt)
            ctx.failpoints.hit("after_claim")
            response = await run_shielded(governed, result)
            if response is not None:
                return response
            seen.ran = result.job.id
            result = await _reread(governed, seen.ran)  # lost the CAS: the winner's answer
            continue
        job = result.job
        _check_own(job, seen.ran)
        fingerprint = governed.intent.fingerprint
        ask = seen.question.may_ask(ctx, job)
        decision = decide(
            job, fingerprint, ctx.policy, wait_expired=loop.time() >= deadline, ask=ask
        )
        # The answers are given here, without a coroutine of their own: a replay is the hot path.
        match decision:
            # Class patterns without captures: a capture makes CPython build a set of the
            # attribute names (match_class), on every replay.
            case Replay():
                # SPEC §11: sealed at rest, opened after the fingerprint matched; one that
                # does not open, or one in the clear under `encryption.require_sealed`, is
                # refused (500 response-unreadable), never forwarded. Whichever layer it came
                # from (the store, a replay cache, a held duplicate's re-read).
                stored = ctx.store.opened(job, decision.response)
                # SPEC §7: fitted to this retry's Accept-Encoding and Origin, on every path
                # that replays (a completed job, a held duplicate, either cache).
                request = governed.request
                fit = unfit(stored, request.headers, head=request.method == "HEAD")
                if fit is not None:
                    stored = await fitted(stored, fit, ctx.settings.max_stored_body)
                governed.trace.replayed(job.id)
                if ctx.tracing is not None:
                    ctx.tracing.replay(job.id, stored.status)
                decoded = fit is not None and bool(fit.codings)
                return replay_response(job.id, stored, ctx.replays, decoded=decoded)
            case Reject():
                raise seen.question.next_check_of(decision.problem())
            case AskAbout():  # SPEC §3.6 (resolve): send again or ask, then decide again
                resent = await seen.question.ask(governed, job, ran=seen.ran is not None)
                result = resent or await _reread(governed, seen.ran)
            case _:
                result = await _act(governed, job, decision, deadline=deadline, ran=seen.ran)
    raise RequestInFlight()


async def _act(
    governed: GovernedRequest,
    job: Job,
    decision: Hold | TakeOver | StartNextAttempt | Forget,
    *,
    deadline: float,
    ran: str | None,
) -> ClaimResult:
    """The one I/O step of a decision that does not answer the client yet, after which it
    decides again. `ran` is the job this request ran an attempt of, if it did."""
    ctx = governed.ctx
    match decision:
        case Hold():
            governed.trace.held = True
            holding = _hold(governed, job, deadline, ran)
            if ctx.tracing is not None:
                holding = ctx.tracing.hold(job.id, holding)
            return await holding
        case TakeOver():
            await ctx.store.take_over(job)  # winners and losers alike re-read the job
            return await _reread(governed, ran)
        case StartNextAttempt():
            _refuse_if_ran(job, ran)
            _refuse_if_draining(ctx)
            claimed = await _start_next_attempt(ctx, job, governed.route.upstream)
            return claimed or await _reread(governed, ran)
        case Forget():
            _refuse_if_ran(job, ran)
            await ctx.store.forget(job)
            return await _reclaim(governed)
        case _:
            assert_never(decision)


async def _start_next_attempt(ctx: ProxyContext, job: Job, upstream: str) -> Claimed | None:
    """SPEC §2.3: the next attempt of a released job. A failed call may still commit (its
    answer lost, or a stalled server): nothing was forwarded under that attempt, so it is
    released once the store answers (proxy/background/unsent.py), as a failed claim's job is."""
    token = new_job_id()  # a fresh UUID: the job's `started_by` if this statement commits
    try:
        return await ctx.store.start_next_attempt(
            job, upstream, lease=ctx.settings.lease, token=token
        )
    except (StoreUnavailable, asyncio.CancelledError):
        ctx.unsent.note_next(job, token)
        raise


async def _reclaim(governed: GovernedRequest) -> ClaimResult:
    """A claim afresh after the job under the key was forgotten: a problem it raises (quota,
    store) is about no job, not the one that is gone (SPEC §8)."""
    try:
        return await _claim(governed)
    except ProblemError as problem:
        problem.about_no_job()
        raise


def _refuse_if_ran(job: Job, ran: str | None) -> None:
    """Released (an operator resolved the job taken over from under this request's attempt) or
    expired: running it again would be this request's second execution."""
    if ran is not None:
        raise _lost(job.id, f"it is {job.state.value} again")


def _check_own(job: Job, ran: str | None) -> None:
    """After its attempt lost the CAS, a request answers only from its own job: another one
    under the key means an operator deleted this one (and a retry claimed the key afresh)."""
    if ran is not None and job.id != ran:
        raise _lost(ran, f"job {job.id} holds its key now")


async def run_shielded(governed: GovernedRequest, claimed: Claimed) -> web.StreamResponse | None:
    """SPEC §2: the client disconnecting must not cancel the upstream call or the completion."""
    ctx = governed.ctx
    task = asyncio.create_task(run_claimed(governed, claimed))  # SPEC §3.6 (resolve)
    ctx.attempts.add(task)
    task.add_done_callback(ctx.attempts.discard)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not _cut_off_by_shutdown(task, governed.request):
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


async def _claim(governed: GovernedRequest, *, forwarded_if_failed: bool = False) -> ClaimResult:
    if governed.transition is not None:  # not a coroutine more on every claim without it
        return await _claim_in_transition(governed, forwarded_if_failed)
    ctx, route, intent = governed.ctx, governed.route, governed.intent
    _refuse_if_draining(ctx)
    job_id = new_job_id()
    if ctx.quotas is not None:
        return await _claim_within(governed, ctx.quotas, job_id, forwarded_if_failed)
    claiming = ctx.store.claim(
        intent, job_id, route.upstream, ttl=route.ttl, lease=ctx.settings.lease
    )
    if ctx.tracing is not None:
        claiming = ctx.tracing.claim(claiming)
    try:
        return await claiming
    except (StoreUnavailable, asyncio.CancelledError):
        # The store may still commit it (a stalled server; or a cancelled caller's batch, which
        # runs to its end for the others: store/batching.py): a job nobody runs. Unless the
        # request goes upstream anyway, nothing was forwarded under it, so it may be released.
        if not forwarded_if_failed:
            ctx.unsent.note(intent.owner, intent.key, job_id)
        raise


async def _claim_in_transition(governed: GovernedRequest, forwarded_if_failed: bool) -> ClaimResult:
    """SPEC §5, `owner.legacy_owners`: a job the credential's owner had before the pepper is
    this request's job (replayed, held, retried under that owner; the loop follows its owner),
    never claimed afresh beside it. Looked for before every claim, and again after a claim that
    created a job: a proxy without the pepper may have claimed the legacy owner's key in
    between. Then the new job, forwarded nowhere yet, is deleted (a duplicate held on it wakes,
    claims again and finds the legacy job too), and the request follows the legacy one."""
    transition = governed.transition
    assert transition is not None
    found = await _live_legacy_job(governed, transition.legacy)
    if found is not None:
        return Existing(found)
    peppered = replace(governed, intent=replace(governed.intent, owner=transition.owner))
    result = await _claim(
        replace(peppered, transition=None), forwarded_if_failed=forwarded_if_failed
    )
    if isinstance(result, Existing):
        return result
    found = await _live_legacy_job(governed, transition.legacy)
    if found is None:
        return result
    await governed.ctx.store.delete(result.job, force=True)
    return Existing(found)


def _in_scope(governed: GovernedRequest, owner: str) -> GovernedRequest:
    """`governed` reading and claiming under `owner` (the peppered or the legacy one)."""
    if governed.intent.owner == owner:
        return governed
    return replace(governed, intent=replace(governed.intent, owner=owner))


async def _live_legacy_job(governed: GovernedRequest, legacy: str) -> Job | None:
    """The job under the legacy owner, unless it expired (SPEC §3.1: then it is gone, and is
    forgotten here, so that a new job is claimed under the peppered owner, not the legacy one)."""
    store = governed.ctx.store
    found = await store.get(legacy, governed.intent.key)
    if found is not None and found.expired and found.state in EXPIRABLE:
        await store.forget(found)
        return None
    return found


async def _claim_within(
    governed: GovernedRequest, limits: QuotaLimits, job_id: str, forwarded_if_failed: bool
) -> ClaimResult:
    """SPEC §9: a key that has a job is a duplicate, read as a claim would read it (from a
    replay cache, if any) and never refused; only a new job is counted against the quotas,
    before anything is claimed or forwarded."""
    ctx, intent = governed.ctx, governed.intent
    existing = await ctx.store.lookup(intent.owner, intent.key)
    if existing is not None:
        return Existing(existing)
    claiming = _counted_claim(governed, limits, job_id)
    if ctx.tracing is not None:
        claiming = ctx.tracing.claim(claiming)
    try:
        return await claiming
    except (StoreUnavailable, asyncio.CancelledError):  # as in `_claim`
        if not forwarded_if_failed:
            ctx.unsent.note(intent.owner, intent.key, job_id)
        raise


async def _counted_claim(
    governed: GovernedRequest, limits: QuotaLimits, job_id: str
) -> ClaimResult:
    ctx, route = governed.ctx, governed.route
    result = await ctx.store.claim_within(
        governed.intent, job_id, route.upstream, ttl=route.ttl, lease=ctx.settings.lease,
        limits=limits,
    )  # fmt: skip
    if isinstance(result, str):
        ctx.metrics.quota_refusals.labels(result).inc()
        raise QuotaExceeded(_QUOTA_DETAIL[result], retry_after=retry_after(result))
    return result


async def _reread(governed: GovernedRequest, ran: str | None = None) -> ClaimResult:
    intent = governed.intent
    job = await governed.ctx.store.get(intent.owner, intent.key)
    return Existing(job) if job is not None else await _claim_unless_ran(governed, ran)


async def _claim_unless_ran(governed: GovernedRequest, ran: str | None) -> ClaimResult:
    """No job under the key: claim it afresh, unless this request already ran an attempt of
    the job that was there (an operator deleted it under that attempt, whose outcome could not
    be stored): a claim now would execute the request a second time."""
    if ran is not None:
        raise _lost(ran, "it was deleted")
    return await _claim(governed)


def _lost(job_id: str, why: str) -> JobLost:
    log.warning(
        "job %s: its attempt's outcome could not be stored (%s); answered 409, not run again",
        job_id,
        why,
    )
    return JobLost()


async def _hold(
    governed: GovernedRequest, job: Job, deadline: float, ran: str | None
) -> ClaimResult:
    """Wait, without a pooled connection, until the job leaves in_flight or the deadline passes."""
    ctx, intent = governed.ctx, governed.intent
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
    return await _claim_unless_ran(governed, ran)


def _still_running(current: Job | None, job: Job) -> bool:
    return (
        current is not None
        and current.id == job.id
        and current.state is JobState.IN_FLIGHT
        and not current.lease_expired
    )
