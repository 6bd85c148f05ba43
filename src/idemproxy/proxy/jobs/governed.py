"""The driver of a governed request's job-level machine (core/machine.py; SPEC §2.2-§2.4).

The machine decides; this loop alone does its I/O: the store calls, the drain flag, the hold's
waits and the attempts (run in a task of their own by `Shield`, so that the client cannot cut
them off; the attempt runner is proxy/jobs/jobrun.py), feeding each result back with
`state.next(...)` until the machine answers.

What the driver does is reported to one observer (`JobObserver`; STYLE: observation beside the
path): the request's record (proxy/server/trace.py: its outcome, job and attempt for the metrics
and the log line), the metrics, the test failpoints and, when `tracing.enabled` is set, the spans
(proxy/tracing.py). Which of them listen is chosen once per process, so the path itself tests for
none of them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, assert_never

from aiohttp import web

from idemproxy.core.machine import (
    About,
    JobGone,
    NeedAdmission,
    NeedAsk,
    NeedClaim,
    NeedClaimDropped,
    NeedForget,
    NeedHold,
    NeedLegacy,
    NeedLegacyForgotten,
    NeedLookup,
    NeedNextAdmission,
    NeedNextAttempt,
    NeedReread,
    NeedResend,
    NeedResendAdmission,
    NeedRun,
    NeedTakeOver,
    NeedWait,
    Refused,
    Replaying,
    Rules,
    Seen,
    Standing,
    State,
    Terms,
    Unnamed,
    begin,
    over_quota,
    stand,
)
from idemproxy.core.quota import QuotaLimits
from idemproxy.core.resolution import Way
from idemproxy.core.types import Claimed, ClaimResult, Existing, Job
from idemproxy.errors import (
    JobLost,
    ProblemError,
    ResponseUnreadable,
    StoreUnavailable,
    UpstreamTimeout,
)
from idemproxy.identity.intent import new_job_id
from idemproxy.observe.metrics import Metrics, RequestOutcome
from idemproxy.proxy.background.unsent import UnsentClaims
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.failpoints import Failpoints
from idemproxy.proxy.jobs.jobrun import (
    AttemptRunner,
    JobRunner,
    Jobs,
    attempt_observer,
)
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.jobs.unknown import UnknownJobs, next_check_of
from idemproxy.proxy.server.capture import drop_unsent
from idemproxy.proxy.server.fit import fitted, unfit
from idemproxy.proxy.server.replay import SharedBodies, replay_response
from idemproxy.proxy.server.trace import Trace
from idemproxy.store.layers import Rereader, record_reread
from idemproxy.store.ports import JobStore

if TYPE_CHECKING:
    from idemproxy.proxy.background.unsent import UnsentClaims
    from idemproxy.proxy.failpoints import Failpoints
    from idemproxy.proxy.server.trace import Trace
    from idemproxy.proxy.tracing import Tracing
    from idemproxy.store.ports import JobStore


log = logging.getLogger(__name__)
_NEW = RequestOutcome.NEW
T = TypeVar("T")
_CUT_OFF = (
    "The proxy shut down before the upstream answered; the request may have executed. Retries "
    "with this Idempotency-Key get 409 outcome-unknown until an operator resolves the job."
)


# The client's response, or None when another attempt completed the job first (jobrun.py).
RunJob = Callable[[GovernedRequest, Claimed], Coroutine[Any, Any, web.StreamResponse | None]]


# The states whose I/O is off the hot path (`Governor._step`).
OffHotPath = (
    NeedLookup
    | NeedHold
    | NeedReread
    | NeedTakeOver
    | NeedNextAdmission
    | NeedNextAttempt
    | NeedForget
    | NeedLegacy
    | NeedLegacyForgotten
    | NeedClaimDropped
    | NeedResendAdmission
    | NeedResend
    | NeedAsk
)
# SPEC §3.6: the states of a retry's question about its `unknown` job.
AboutUnknown = NeedResendAdmission | NeedResend | NeedAsk


@dataclass(frozen=True, slots=True)
class Collaborators:
    """What the driver works with, given once per process."""

    store: JobStore
    rules: Rules
    # SPEC §9: the limits per owner; None when no quota is set (claims stay one statement).
    quotas: QuotaLimits | None
    lease: float
    # SPEC §11, `on_store_error: passthrough`: a first claim the store could not take is
    # forwarded ungoverned by the caller.
    passes_through: bool
    max_stored_body: int
    # The process's drain flag (proxy/drain.py), read when the machine asks for it.
    draining: Callable[[], bool]
    # Claims that failed (503, nothing forwarded) but may still commit: released when they do.
    unsent: UnsentClaims
    # Runs the attempts of a claimed job; their tasks outlive a client that hangs up (SPEC §2).
    shield: Shield
    replays: SharedBodies
    # Told what happened: the request's record, metrics, failpoints and spans listen.
    observer: JobObserver
    # SPEC §3.6: resending and asking about `unknown` jobs; None when no route resolves them.
    unknown: UnknownJobs | None = None
    # SPEC §11: a job whose response did not open, read again from the store of record once
    # the caches dropped their copies (store/layers.py); None when no cache stands in front.
    reread: Rereader | None = None


class Governor:
    """Answers governed requests (SPEC §2.2-§2.4): built once per process, called per request."""

    __slots__ = ("_with",)

    def __init__(self, collaborators: Collaborators) -> None:
        self._with = collaborators

    @classmethod
    def of(cls, ctx: ProxyContext) -> Governor:
        settings = ctx.settings
        rules = Rules(
            ctx.policy,
            settings.max_waiters_per_key,
            settings.max_waiters,
            quotas=ctx.quotas is not None,
        )
        observer = job_observer(ctx.metrics, ctx.failpoints, ctx.tracing)
        jobs = _jobs(ctx)
        unknown = _unknown_jobs(ctx, observer, jobs)
        run = jobs.run if unknown is None else unknown.run_claimed
        return cls(
            Collaborators(
                store=ctx.store,
                rules=rules,
                quotas=ctx.quotas,
                lease=settings.lease,
                passes_through=settings.on_store_error == "passthrough",
                max_stored_body=settings.max_stored_body,
                # Read by a C-level call, not a lambda of ours: on every request.
                draining=functools.partial(getattr, ctx, "draining"),
                unsent=ctx.unsent,
                shield=Shield(run, ctx.attempts),
                replays=ctx.replays,
                observer=observer,
                unknown=unknown,
                reread=record_reread(ctx.store),
            )
        )

    async def __call__(self, governed: GovernedRequest) -> web.StreamResponse | None:
        """The answer to a governed request, or None when the store could not take its first
        claim and the settings say to forward it ungoverned then (`on_store_error:
        passthrough`, SPEC §11): the caller passes it through. Nothing was claimed, so nothing
        can run twice."""
        at = self._with
        transition = governed.transition
        legacy = None if transition is None else transition.legacy
        intent = governed.intent
        terms = (
            Terms(
                at.rules,
                intent.fingerprint,
                governed.route.max_wait,
                legacy,
                earlier_fingerprint=intent.earlier_fingerprint,
            )
            if at.unknown is None
            else self._resolving_terms(governed, legacy, at.unknown)
        )
        state = begin(terms, at.draining())
        clock = asyncio.get_running_loop().time
        reread = at.reread
        try:
            while True:
                # Class patterns without captures: a capture makes CPython build a set of the
                # attribute names (match_class), on every request.
                match state:
                    case NeedClaim():
                        state = state.next(await self._claim(governed, state), clock())
                    case Replaying():
                        # The answer is given here, without a coroutine of its own: a replay is
                        # the hot path.
                        try:
                            stored = at.store.opened(state.seen.job, state.response)
                        except ResponseUnreadable as unreadable:
                            state = await _from_the_record(
                                state, reread, unreadable, terms, at.draining(), clock()
                            )
                            # Once per request: a copy that does not open again (put back
                            # meanwhile) is the 500, never a loop.
                            reread = None
                            continue
                        # SPEC §7: fitted to this retry's Accept-Encoding and Origin, on every
                        # path that replays (a completed job, a held duplicate, either cache).
                        request = governed.request
                        fit = unfit(stored, request.headers, head=request.method == "HEAD")
                        if fit is not None:
                            stored = await fitted(stored, fit, at.max_stored_body)
                        job_id = state.seen.job.id
                        at.observer.replayed(governed.trace, job_id, stored.status)
                        decoded = fit is not None and bool(fit.codings)
                        return replay_response(job_id, stored, at.replays, decoded=decoded)
                    case NeedRun():
                        claimed = state.claimed
                        at.observer.running(governed.trace, claimed)
                        response = await at.shield.run(governed, claimed)
                        if response is not None:
                            return response
                        state = state.lost()  # lost the CAS: the winner's answer
                    case NeedAdmission():
                        state = state.next(at.draining())
                    case Refused() | JobGone():
                        raise _refusal(state)
                    case _:
                        state = await self._step(governed, state, clock)
        except ProblemError as problem:
            standing = state.standing()
            first = standing is Unnamed.FIRST
            if first and at.passes_through and isinstance(problem, StoreUnavailable):
                return None
            # SPEC §8: the answer names the job it is about and the state it was last read in;
            # so does its log line (SPEC §13), a 409 included.
            stand(problem, standing)
            at.observer.refused(governed.trace, standing)
            raise

    def _resolving_terms(
        self, governed: GovernedRequest, legacy: str | None, unknown: UnknownJobs
    ) -> Terms:
        """The request's terms on a process with routes that resolve unknown jobs (SPEC §3.6):
        with what its own route can do about one."""
        resends, asks = unknown.resends(governed.route), unknown.asks(governed.route)
        intent, max_wait = governed.intent, governed.route.max_wait
        return Terms(
            self._with.rules,
            intent.fingerprint,
            max_wait,
            legacy,
            resends,
            asks,
            intent.earlier_fingerprint,
        )

    async def _step(
        self, governed: GovernedRequest, state: OffHotPath, clock: Callable[[], float]
    ) -> State:
        """One I/O step off the hot path (new keys and replays do without it)."""
        at = self._with
        match state:
            case NeedLookup():
                intent = governed.intent
                found = await at.store.lookup(intent.owner, intent.key)
                return state.next(found, clock())
            case NeedHold():
                holding = self._hold(governed, state, clock)
                job_id = state.seen.job.id
                return (await at.observer.holding(governed.trace, job_id, holding))[0]
            case NeedReread():
                return state.next(await self._reread(governed, state.seen), clock())
            case NeedTakeOver():
                await self._take_over(state.seen.job)
                return state.next()
            case NeedNextAdmission():
                return state.next(at.draining())
            case NeedNextAttempt():
                claimed_next = await self._start_next_attempt(governed, state.seen.job)
                return state.next(claimed_next, clock())
            case NeedForget():
                await at.store.forget(state.seen.job)
                return state.next()
            case NeedLegacy():
                legacy = state.terms.legacy
                assert legacy is not None  # the legacy owner: NeedLegacy comes only with it
                found = await at.store.get(legacy, governed.intent.key)
                return state.next(found, clock())
            case NeedLegacyForgotten():
                await at.store.forget(state.job)
                return state.next(clock())
            case NeedClaimDropped():
                await at.store.delete(state.claimed.job, force=True)
                return state.next(clock())
            case NeedResendAdmission() | NeedResend() | NeedAsk():
                return await self._about_unknown(governed, state, clock)
            case _:
                assert_never(state)

    async def _take_over(self, job: Job) -> None:
        """SPEC §3.5: the job's lease ran out; of everyone who tries, one CAS wins."""
        at = self._with
        if await at.store.take_over(job):
            at.observer.took_over(job)

    async def _about_unknown(
        self, governed: GovernedRequest, state: AboutUnknown, clock: Callable[[], float]
    ) -> State:
        """SPEC §3.6: one step of a retry's question about its `unknown` job."""
        at = self._with
        unknown = at.unknown
        assert unknown is not None  # the machine asks only on a route that resolves
        match state:
            case NeedResendAdmission():
                return state.next(at.draining())
            case NeedResend():
                resent = await unknown.resend(governed, state.seen.job)
                return state.next(resent, clock())
            case NeedAsk():
                return state.next(await unknown.ask(governed.route, state.seen.job))
            case _:
                assert_never(state)

    async def _claim(self, governed: GovernedRequest, state: NeedClaim) -> ClaimResult:
        at, intent = self._with, governed.intent
        job_id = new_job_id()
        if at.quotas is not None:
            claiming = self._claim_within(governed, at.quotas, job_id)
        else:
            claiming = at.store.claim(
                intent, job_id, governed.route.upstream, ttl=governed.route.ttl, lease=at.lease
            )
        try:
            return await at.observer.claiming(claiming)
        except (StoreUnavailable, asyncio.CancelledError):
            # The store may still commit it (a stalled server; or a cancelled caller's batch,
            # which runs to its end for the others: store/batching.py): a job nobody runs.
            # Unless the request goes upstream anyway, nothing was forwarded under it, so it
            # may be released.
            if not (at.passes_through and state.seen is None):
                at.unsent.note(intent.owner, intent.key, job_id)
            raise

    async def _claim_within(
        self, governed: GovernedRequest, limits: QuotaLimits, job_id: str
    ) -> ClaimResult:
        """SPEC §9: only a new job is counted against the quotas, before anything is claimed
        or forwarded; a refusal is raised here, inside the claim's span."""
        at, route = self._with, governed.route
        result = await at.store.claim_within(
            governed.intent, job_id, route.upstream, ttl=route.ttl, lease=at.lease, limits=limits
        )
        if isinstance(result, str):
            at.observer.over_quota(result)
            raise over_quota(result)
        return result

    async def _start_next_attempt(self, governed: GovernedRequest, job: Job) -> Claimed | None:
        """SPEC §2.3: the next attempt of a released job. A failed call may still commit (its
        answer lost, or a stalled server): nothing was forwarded under that attempt, so it is
        released once the store answers (proxy/background/unsent.py), as a failed claim's job
        is."""
        at = self._with
        token = new_job_id()  # a fresh UUID: the job's `started_by` if this statement commits
        try:
            return await at.store.start_next_attempt(
                job, governed.route.upstream, lease=at.lease, token=token
            )
        except (StoreUnavailable, asyncio.CancelledError):
            at.unsent.note_next(job, token)
            raise

    async def _reread(self, governed: GovernedRequest, seen: Seen) -> Job | None:
        return await self._with.store.get(_scope(governed, seen), governed.intent.key)

    async def _hold(
        self, governed: GovernedRequest, state: NeedHold, clock: Callable[[], float]
    ) -> tuple[State, Job | None]:
        """Wait, without a pooled connection, until the job leaves in_flight or the deadline
        passes; the next state, and the job read last."""
        at = self._with
        watch, job = at.store.watch, state.seen.job
        admitted = state.next(watch.waiting_for(job.id), watch.waiting)
        if isinstance(admitted, Refused):
            raise admitted.error()  # inside the hold's span, as its end
        owner, key = _scope(governed, state.seen), governed.intent.key
        async with at.store.watching(job.id) as subscription:
            found = await at.store.watch_job(owner, key)
            held = admitted.next(found, clock(), at.draining())
            while isinstance(held, NeedWait):
                await subscription.wait(held.seconds)
                found = await at.store.get(owner, key)
                held = held.next(found, clock(), at.draining())
            if isinstance(held, Refused):
                raise held.error()
        return held, found


def _refusal(state: Refused | JobGone) -> ProblemError:
    if isinstance(state, Refused):
        return next_check_of(state.error(), state.next_check)
    log.warning(
        "job %s: its attempt's outcome could not be stored (%s); answered 409, not run again",
        state.job_id,
        state.why,
    )
    return stand(JobLost(), state.about)


def _jobs(ctx: ProxyContext) -> Jobs:
    """What runs a claimed job's attempts, with this process's collaborators."""
    attempts = AttemptRunner(
        ctx.settings, ctx.store, ctx.upstream, ctx.statuses, ctx.budget, ctx.unwritten,
        ctx.metrics, ctx.failpoints, attempt_observer(ctx.tracing),
    )  # fmt: skip
    runner = JobRunner(attempts, ctx.store, ctx.unsent, ctx.attempts, ctx.settings.lease)
    return Jobs(attempts, runner)


def _unknown_jobs(ctx: ProxyContext, observer: JobObserver, jobs: Jobs) -> UnknownJobs | None:
    """SPEC §3.6: only with a route that resolves unknown jobs (either way)."""
    resolves = (route.resolve for route in ctx.settings.all_routes)
    if not any(way.upstream_honours_key or way.reconcile for way in resolves):
        return None
    return UnknownJobs(
        ctx.store,
        lambda: ctx.reconciler,
        jobs,
        lease=ctx.settings.lease,
        on_resent=observer.resent,
    )


def _scope(governed: GovernedRequest, seen: Seen) -> str:
    """The owner a job is read under: the job's own in the transition (peppered or legacy,
    SPEC §5), the request's otherwise."""
    return governed.intent.owner if governed.transition is None else seen.job.owner


async def _from_the_record(
    replaying: Replaying,
    reread: Rereader | None,
    unreadable: ResponseUnreadable,
    terms: Terms,
    draining: bool,
    now: float,
) -> State:
    """SPEC §11: the response that did not open came through the caches, whose copy someone
    may have changed (a Redis entry is theirs to write). The caches drop it, and the request is
    decided again on the store of record's job, or claimed as new where the record has none:
    the same answer the store would have given without them. When the record holds the same
    response, it is the 500 it always was."""
    job = replaying.seen.job
    reread_as = None if reread is None else await reread(job, replaying.response)
    if reread_as is None:
        raise unreadable
    if reread_as.job is None:
        log.warning(
            "job %s: a cached copy of its response did not open, and the store holds no job"
            " under its key: claimed as new",
            job.id,
        )
    else:
        log.warning(
            "job %s: a cached copy of its response did not open; answered from the store",
            job.id,
        )
    state = begin(terms, draining)
    if reread_as.job is None or not isinstance(state, NeedClaim):
        return state
    return state.next(Existing(reread_as.job), now)


class Shield:
    """Runs a claimed job's attempts (`Jobs.run`) in a task of their own, kept in `attempts`
    (shutdown waits for them)."""

    __slots__ = ("_attempts", "_run_job")

    def __init__(self, run_job: RunJob, attempts: set[asyncio.Task[Any]]) -> None:
        self._run_job = run_job
        self._attempts = attempts

    async def run(self, governed: GovernedRequest, claimed: Claimed) -> web.StreamResponse | None:
        """SPEC §2: the client disconnecting must not cancel the upstream call or the
        completion."""
        task = asyncio.create_task(self._run_job(governed, claimed))
        self._attempts.add(task)
        task.add_done_callback(self._attempts.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not _cut_off_by_shutdown(task, governed.request):
                # The client left: the attempt goes on, and its response is never sent.
                task.add_done_callback(_drop_result)
                raise
        # SPEC §3.2: the drain's deadline cancelled the attempt and its job is unknown. The
        # first client gets a 504 as for any attempt whose outcome is unknown, not a bare
        # disconnect (unless the response had already started); retries get 409
        # outcome-unknown.
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


class JobObserver:
    """The record, the metrics and the failpoints; no spans."""

    __slots__ = ("_failpoints", "_metrics")

    def __init__(self, metrics: Metrics, failpoints: Failpoints) -> None:
        self._metrics = metrics
        self._failpoints = failpoints

    def claiming(self, claim: Awaitable[ClaimResult]) -> Awaitable[ClaimResult]:
        """The claim of the key (SPEC §2.2), about to be awaited."""
        return claim

    def over_quota(self, limit: str) -> None:
        """SPEC §9: a new job refused by `limit`, counted by limit."""
        self._metrics.quota_refusals.labels(limit).inc()

    def running(self, trace: Trace, claimed: Claimed) -> None:
        """The request runs the job it claimed (its attempts follow): the record's fields set
        here, where the observer is, rather than through a call into the record's module."""
        trace.outcome, trace.job_id, trace.attempt = _NEW, claimed.job.id, claimed.attempt
        if self._failpoints.armed is not None:  # test-only (proxy/failpoints.py)
            self._failpoints.hit("after_claim")

    def holding(
        self, trace: Trace, job_id: str, hold: Awaitable[tuple[T, Job | None]]
    ) -> Awaitable[tuple[T, Job | None]]:
        """A duplicate held on job `job_id` in flight (SPEC §2.3), about to be awaited."""
        trace.held = True
        return hold

    def replayed(self, trace: Trace, job_id: str, status: int) -> None:
        """The stored response of `job_id` goes out again (SPEC §7)."""
        trace.replayed(job_id)

    def refused(self, trace: Trace, standing: Standing) -> None:
        """The request is answered with a problem about the job `standing` names, if any."""
        if isinstance(standing, About) and trace.job_id is None:
            trace.job_id = standing.job_id

    def took_over(self, job: Job) -> None:
        """SPEC §3.5: a retry of its key found the job's lease run out (its proxy died
        mid-attempt) and took it over as `unknown`: logged and counted as the background's
        takeovers are (proxy/background/orphans.py), an operator's task either way."""
        self._metrics.orphans_taken_over.inc()
        log.warning(
            "job %s: its lease ran out (its proxy died, stalled, or could not store the outcome: "
            "see its store errors); taken over as unknown by a retry of its key after %d "
            "attempt(s), for an operator to resolve",
            job.id,
            job.attempt_count,
        )

    def resent(self, result: str) -> None:
        """SPEC §3.6, §13: an `unknown` job sent again under the key its upstream honours, and
        what became of it (`completed`, `unknown`, `lost`)."""
        self._metrics.resolutions.labels(Way.UPSTREAM_KEY.value, result).inc()


class TracedJobObserver(JobObserver):
    """As `JobObserver`, and the spans of the claim, the hold and the replay (proxy/tracing.py)."""

    __slots__ = ("_tracing",)

    def __init__(self, metrics: Metrics, failpoints: Failpoints, tracing: Tracing) -> None:
        super().__init__(metrics, failpoints)
        self._tracing = tracing

    def claiming(self, claim: Awaitable[ClaimResult]) -> Awaitable[ClaimResult]:
        return self._tracing.claim(claim)

    def holding(
        self, trace: Trace, job_id: str, hold: Awaitable[tuple[T, Job | None]]
    ) -> Awaitable[tuple[T, Job | None]]:
        trace.held = True
        return self._tracing.hold(job_id, hold)

    def replayed(self, trace: Trace, job_id: str, status: int) -> None:
        trace.replayed(job_id)
        self._tracing.replay(job_id, status)


def job_observer(metrics: Metrics, failpoints: Failpoints, tracing: Tracing | None) -> JobObserver:
    """The observer of a process: with spans only when tracing is on."""
    if tracing is None:
        return JobObserver(metrics, failpoints)
    return TracedJobObserver(metrics, failpoints, tracing)
