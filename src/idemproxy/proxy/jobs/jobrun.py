"""Running a job's attempts: across an upstream group, the driver of core/attempt_order.py
(SPEC §3.4), and each attempt's steps, the driver of the attempt's machine in core/machine.py
(`AttemptRunner`: forward under a kept lease, capture or stream, check, complete or settle,
answer).

In order: the primary, then each fallback while the outcome proves nothing executed (released),
every try a new attempt under the same job. Hedged (`hedge_after`): after that delay with no
answer, one more attempt starts on the next upstream; the first attempt to complete wins the
CAS and the others' results are discarded and recorded. The machine keeps the race's
bookkeeping; this driver owns the tasks, the hedge timer and the responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, assert_never

from aiohttp import hdrs, web
from multidict import CIMultiDict
from yarl import URL

from idemproxy.constants import ATTEMPT_HEADER, JOB_HEADER, STREAMING_MEDIA_TYPES
from idemproxy.core.attempt_order import (
    AddHedge,
    FailOver,
    Race,
    RaceLost,
    RacerEnd,
    RaceState,
    RaceStoreError,
    SettleRace,
    Try,
    Wait,
    racer_end,
)
from idemproxy.core.machine import (
    Abort,
    Answer,
    AnswerProblem,
    AttemptState,
    Body,
    BodyCaptured,
    BodyCut,
    BodyEnded,
    Capture,
    CheckContract,
    Checked,
    Complete,
    Failed,
    Finish,
    Forward,
    HandBack,
    Head,
    KeepReply,
    Lost,
    Mode,
    Outcome,
    Settle,
    StatusPolicy,
    Stream,
    StreamThrough,
    TransportFailed,
    cut_off,
    settled_state,
)
from idemproxy.core.types import Claimed, HeaderPairs, Job, JobState, StoredResponse
from idemproxy.errors import (
    ProblemError,
    StoreUnavailable,
    UpstreamUnavailable,
)
from idemproxy.http.headers import (
    REASON_FIELD,
    STANDARD_REASONS,
    outgoing,
    response_headers,
    response_headers_for_client,
)
from idemproxy.http.problems import problem_response
from idemproxy.identity.intent import new_job_id
from idemproxy.observe.metrics import AttemptOutcome, Metrics, UpstreamOutcome
from idemproxy.proxy.background.unsent import UnsentClaims
from idemproxy.proxy.failpoints import Failpoints
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.reasons import FailureReason, upstream_reason
from idemproxy.proxy.routing import upstream_origin
from idemproxy.proxy.server.capture import Captured, answer, capture, drop_unsent, tee
from idemproxy.proxy.server.connection import AsSentStreamResponse
from idemproxy.proxy.server.sink import ClientSink
from idemproxy.proxy.server.trace import Trace
from idemproxy.proxy.upstream.client import UpstreamClient, UpstreamFailure, UpstreamResponse
from idemproxy.proxy.upstream.contract import ask_checkable
from idemproxy.store.base import AttemptFailure
from idemproxy.store.ports import JobStore

if TYPE_CHECKING:
    from idemproxy.config.settings import Settings
    from idemproxy.proxy.background.unsent import UnsentClaims
    from idemproxy.proxy.background.unwritten import UnwrittenOutcomes
    from idemproxy.proxy.failpoints import Failpoints
    from idemproxy.proxy.server.capture import ResponseBudget
    from idemproxy.proxy.server.trace import Trace
    from idemproxy.proxy.tracing import Tracing
    from idemproxy.store.ports import JobStore


log = logging.getLogger(__name__)


# After forwarding, "the request was not forwarded" (StoreUnavailable's default) would be a lie.
# The outcome is written once the store answers (proxy/background/unwritten.py); if the job's lease
# runs out first, it becomes unknown (SPEC §3.5).
_FORWARDED_NOT_STORED = (
    "The request was forwarded, but its outcome could not be stored; retry later with the same "
    "Idempotency-Key to learn it."
)
# A failed renewal is tried again this soon, then twice as late each time (up to lease / 10):
# waiting a third of the lease, as a renewal due on time does, can outlast what is left of it.
_FIRST_RETRY_SECONDS = 0.05
# Below this much time left, a try is bounded only by the store's own timeout: a shorter bound
# could never succeed, and a renewal after the lease ran out still keeps a job that nobody took
# over (the statement is a CAS on the job's version, not on its lease).
_MIN_BOUNDED_TRY_SECONDS = 0.1


@dataclass(frozen=True, slots=True)
class HandedBack:
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
    place among the job's attempts (core/machine.py, `Mode`)."""

    job: Job
    number: int
    upstream: str
    mode: Mode = Mode.FINAL
    # SPEC §3.6: the request sent again under the key its upstream honours (core/machine.py
    # `Forward.resend`).
    resend: bool = False


Step = web.StreamResponse | HandedBack | None


@dataclass(slots=True)
class AttemptRunner:
    """Runs attempts with the collaborators of one process, given when it is built."""

    settings: Settings
    store: JobStore
    upstream: UpstreamClient
    statuses: StatusPolicy
    budget: ResponseBudget
    unwritten: UnwrittenOutcomes
    metrics: Metrics
    failpoints: Failpoints
    observer: AttemptObserver

    async def run(self, governed: GovernedRequest, attempt: AttemptRun) -> Step:
        request, route, job = governed.request, governed.route, attempt.job
        edits = route.header_edits.get(attempt.upstream, ())
        trusted = self.settings.trusted_proxies
        url, headers = outgoing(request, attempt.upstream, route.forward_host, edits, trusted)
        headers[JOB_HEADER] = job.id  # SPEC §10: the backend can honour the same identity
        headers[ATTEMPT_HEADER] = str(attempt.number)
        if route.gate is not None:  # SPEC §3.4: only answers the contract check can decode
            ask_checkable(headers)
        _names(governed.trace, attempt)  # a fail-over's too
        forwarding = self._forward(governed, attempt, url, headers)
        # Its traceparent, when spans are on, joins `headers` before they are sent.
        ids = (job.id, attempt.number)
        return await self.observer.forwarding(request.method, url, headers, ids, forwarding)

    async def _forward(
        self, governed: GovernedRequest, attempt: AttemptRun, url: URL, headers: CIMultiDict[str]
    ) -> Step:
        request, body = governed.request, governed.body
        forward = Forward(
            attempt.mode, governed.route.gate is not None, self.statuses, attempt.resend
        )
        started = time.perf_counter()
        try:
            async with KeptLease(self.store, attempt.job, lease=self.settings.lease):
                exchange, upstream = await self.upstream.send(
                    request.method,
                    url,
                    headers,
                    body.memory if body.memory is not None else body.reader(),
                    content_length=body.size,
                    timeout=governed.route.upstream_timeout,
                )
                try:
                    media_type = upstream.headers.get("Content-Type", "").partition(";")[0]
                    stream = media_type.strip().lower() in STREAMING_MEDIA_TYPES
                    head = Head(upstream.status, stream)
                    step = await self._drive(governed, attempt, upstream, forward.next(head))
                    # Until the upstream's answer was whole, not until it was stored: the
                    # store's time is idemproxy_store_seconds' (SPEC §13).
                    ended = upstream.finished_at or time.perf_counter()
                    handed = type(step) is HandedBack
                    answered = UpstreamOutcome.FAILED if handed else UpstreamOutcome.ANSWERED
                    by_outcome = self.metrics.upstream_call[upstream_origin(attempt.upstream)]
                    by_outcome[answered].observe(ended - started)
                    return step
                finally:
                    # Only now, the answer stored: bytes the upstream sends after its answer
                    # land on this finished exchange (and the connection is not reused), never
                    # on the next request's (tests/hostile/test_upstream_faults.py).
                    await exchange.close()
        except UpstreamFailure as failure:  # no (whole) response before its head went out
            state = forward.next(TransportFailed(failure.failure, failure.reason))
            assert isinstance(state, Settle | HandBack)
            failed = state.failed
            by_outcome = self.metrics.upstream_call[upstream_origin(attempt.upstream)]
            by_outcome[UpstreamOutcome(failed.outcome.value)].observe(time.perf_counter() - started)
            self._log_failure(governed, attempt, failure)
            self.observer.upstream_failed(failure.reason, failed.outcome)
            if isinstance(state, HandBack):
                return _handed_back(failed)
            await self.settle(attempt, failed)
            return self.problem(attempt, failed)
        except asyncio.CancelledError:
            # Cut off by shutdown: the request may have reached the upstream (SPEC §3.2).
            await asyncio.shield(self.settle(attempt, cut_off("cut off by shutdown")))
            raise

    async def _drive(  # noqa: C901, PLR0912, PLR0915 -- one case per state of the machine
        self,
        governed: GovernedRequest,
        attempt: AttemptRun,
        upstream: UpstreamResponse,
        state: AttemptState,
    ) -> Step:
        kept: Captured | None = None  # the body as captured (or teed), until handed on
        # The client's headers, once the completion made them with the stored ones.
        client_headers: CIMultiDict[str] | None = None
        client: ClientSink | None = None  # once the head went to the client
        response: web.StreamResponse | None = None
        try:
            while True:
                match state:
                    case Capture():
                        kept = await self._capture(upstream, state.mode)
                        state = state.next(BodyCaptured(kept.whole))
                    case CheckContract():
                        assert kept is not None
                        broken = await self._violations(governed, attempt, upstream, kept)
                        if broken:  # neither stored nor passed on
                            kept.close()
                            kept = None
                        state = state.next(Checked(broken))
                    case Complete():
                        client_headers, stored_headers = self._response_headers(
                            upstream, attempt.job
                        )
                        body = None
                        if state.body is Body.KEPT and kept is not None and kept.whole:
                            # Its `memory`, nearly always: `content` only for a body in
                            # pieces or on disk.
                            body = kept.memory
                            if body is None:
                                body = await kept.content()
                        stored = StoredResponse(upstream.status, stored_headers, body)
                        completing = self._completed(attempt, stored, governed.route.ttl)
                        if state.after_head:
                            state = state.next(await _after_head(attempt, completing))
                            continue
                        buffered = state.body is Body.KEPT
                        # Test-only crash points (proxy/failpoints.py): none armed in service.
                        armed = buffered and self.failpoints.armed is not None
                        if armed:
                            self.failpoints.hit("before_store")
                        won = await completing
                        if won and armed:
                            self.failpoints.hit("after_store")
                        state = state.next(won)
                    case Settle():
                        settling = self.settle(attempt, state.failed)
                        if state.after_head:
                            await _after_head(attempt, settling)
                        else:
                            await settling
                        state = state.next()
                    case Stream():
                        response, client = await self._open(governed, upstream, attempt.job)
                        try:
                            kept = await tee(
                                upstream, client, self.settings.max_stored_body, self.budget
                            )
                        except UpstreamFailure as failure:
                            state = state.next(BodyCut(failure.reason))
                        else:
                            state = state.next(BodyEnded())
                    case StreamThrough():
                        # SPEC §7: a body over max_stored_body streams through and is not kept.
                        assert kept is not None
                        response, client = await self._open(
                            governed, upstream, attempt.job, sized=True
                        )
                        head, kept = kept, None
                        state = state.next(await _pass_through(head, upstream, client))
                    case Answer():
                        assert kept is not None
                        answered, kept = kept, None  # the response owns it now
                        # A race's winner, not the attempt started last (SPEC §13).
                        _names(governed.trace, attempt)
                        if client_headers is None:  # a settled attempt's answer
                            client_headers = self._client_headers(upstream, attempt.job)
                        return answer(answered, upstream.status, upstream.reason, client_headers)
                    case Finish():
                        assert client is not None
                        _names(governed.trace, attempt)
                        if kept is not None:
                            kept.close()
                            kept = None
                        await client.finish()
                        return response
                    case Abort():
                        assert client is not None
                        client.abort()
                        return response
                    case AnswerProblem():
                        return self.problem(attempt, state.failed)
                    case HandBack():
                        return _handed_back(state.failed)
                    case KeepReply():  # it may be the last answer the race gets
                        reply = await self._reply(upstream, attempt)
                        return _handed_back(state.failed, reply)
                    case Lost():
                        return None
                    case Forward():
                        raise AssertionError("an attempt forwards once")
                    case _:
                        assert_never(state)
        finally:
            if kept is not None:
                kept.close()

    async def _capture(self, upstream: UpstreamResponse, mode: Mode) -> Captured:
        """The body up to max_stored_body, within the response budget (proxy/server/capture.py).
        A body declared larger is not waited for: it streams through at once (SPEC §7). In a
        race it is: its head alone wins nothing, a racer wins once more than max_stored_body
        bytes of it arrived (docs/attempts.md, Hedging), and one cut off before is unknown."""
        limit = self.settings.max_stored_body
        declared = upstream.content_length
        if (
            declared is not None
            and declared > limit
            and upstream.method != "HEAD"
            and mode is not Mode.HEDGED
        ):
            return Captured(self.budget)
        return await capture(upstream, limit, self.budget)

    async def _reply(
        self, upstream: UpstreamResponse, attempt: AttemptRun
    ) -> web.StreamResponse | None:
        try:
            captured = await capture(upstream, self.settings.max_stored_body, self.budget)
        except UpstreamFailure:
            return None
        if not captured.whole:
            captured.close()
            return None
        headers = self._client_headers(upstream, attempt.job)
        return answer(captured, upstream.status, upstream.reason, headers)

    async def _open(
        self,
        governed: GovernedRequest,
        upstream: UpstreamResponse,
        job: Job,
        *,
        sized: bool = False,
    ) -> tuple[web.StreamResponse, ClientSink]:
        """The client's response, its head sent now rather than with the first byte of the body;
        `sized` keeps the upstream's Content-Length (a body passed through whole)."""
        response = AsSentStreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend(self._client_headers(upstream, job))
        if sized and upstream.content_length is not None:
            response.content_length = upstream.content_length
        client = ClientSink(governed.request, response)
        await client.write(b"")
        return response, client

    async def _violations(
        self,
        governed: GovernedRequest,
        attempt: AttemptRun,
        upstream: UpstreamResponse,
        kept: Captured,
    ) -> tuple[str, ...]:
        """What the captured response breaks of the route's contract (SPEC §3.4); a body too
        large to check is a breach too."""
        gate = governed.route.gate
        assert gate is not None
        content = await kept.content() if kept.whole else None
        limit = self.settings.max_stored_body
        broken = await gate.contract.check(upstream.status, upstream.headers, content, limit)
        if broken:
            governed.trace.failed(attempt.upstream, FailureReason.CONTRACT)
            _log_breach(attempt, upstream.status, broken)
        return tuple(broken)

    def problem(self, attempt: AttemptRun, failed: Failed) -> web.StreamResponse:
        problem = failed.problem().about(attempt.job.id, settled_state(failed.outcome).value)
        settings = self.settings
        return problem_response(problem, profile=settings.profile, types=settings.problem_types)

    def _log_failure(
        self, governed: GovernedRequest, attempt: AttemptRun, failure: UpstreamFailure
    ) -> None:
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

    async def _completed(self, attempt: AttemptRun, stored: StoredResponse, ttl: float) -> bool:
        """The completion CAS (SPEC §1); a losing result is discarded, counted and logged."""
        completing = self.observer.completing(
            attempt.job.id,
            attempt.number,
            self.store.complete(attempt.job, attempt.number, stored, ttl=ttl),
        )
        try:
            won = await completing
        except StoreUnavailable as exc:
            self.unwritten.completion(attempt.job, attempt.number, stored, ttl)
            raise StoreUnavailable(_FORWARDED_NOT_STORED) from exc
        outcome = AttemptOutcome.SUCCEEDED if won else AttemptOutcome.DISCARDED
        self.metrics.attempt_outcome[outcome].add(1)
        if not won:
            self.metrics.late_results.inc()
            log.info("late result discarded: job %s attempt %d", attempt.job.id, attempt.number)
        return won

    def count_failed(self, outcome: Outcome) -> None:
        self.metrics.attempt_outcome[
            AttemptOutcome.FAILED if outcome is Outcome.RELEASE else AttemptOutcome.UNKNOWN
        ].inc()

    async def settle(self, attempt: AttemptRun, failed: Failed) -> None:
        self.count_failed(failed.outcome)
        state = settled_state(failed.outcome)
        job, number = attempt.job, attempt.number
        settling = self.observer.settling(
            job.id,
            number,
            state,
            self.store.settle(job, number, state, status=failed.status, error=failed.error),
        )
        try:
            won = await settling
        except StoreUnavailable as exc:
            self.unwritten.settlement(job, number, state, failed.status, failed.error)
            raise StoreUnavailable(_FORWARDED_NOT_STORED) from exc
        if not won:
            log.info("job %s attempt %d: settle lost the CAS", job.id, number)

    def _client_headers(self, upstream: UpstreamResponse, job: Job) -> CIMultiDict[str]:
        return _as_answered(response_headers_for_client(upstream.headers), upstream, job)

    def _response_headers(
        self, upstream: UpstreamResponse, job: Job
    ) -> tuple[CIMultiDict[str], HeaderPairs]:
        """The client's headers (`_client_headers`) and those stored (SPEC §7), made at once."""
        client, stored = response_headers(upstream.headers, tuple(self.settings.unreplayed_headers))
        if upstream.method == "HEAD":
            stored += _head_length(upstream)
        reason = upstream.reason
        if reason != STANDARD_REASONS.get(upstream.status, ""):  # SPEC §7: as the first answer's
            stored = ((REASON_FIELD, reason), *stored)
        return _as_answered(client, upstream, job), stored


def _as_answered(
    headers: CIMultiDict[str], upstream: UpstreamResponse, job: Job
) -> CIMultiDict[str]:
    """The upstream's headers, filtered for the client, as an attempt's answer carries them: a
    HEAD answer's length (`_head_length`) and the job's id (SPEC §7)."""
    if upstream.method == "HEAD":
        headers.extend(_head_length(upstream))
    headers[JOB_HEADER] = job.id
    return headers


async def _pass_through(
    head: Captured, upstream: UpstreamResponse, client: ClientSink
) -> BodyEnded | BodyCut:
    """What was captured, then the rest of the upstream's body, to the client."""
    try:
        async for piece in head.pieces():
            await client.write(piece)
    finally:
        head.close()
    try:
        async for chunk in UpstreamClient.iter_body(upstream):
            await client.write(chunk)
    except UpstreamFailure as failure:
        return BodyCut(failure.reason)
    return BodyEnded()


def _handed_back(failed: Failed, reply: web.StreamResponse | None = None) -> HandedBack:
    return HandedBack(failed.outcome, failed.status, failed.error, failed.problem, reply)


def _log_breach(attempt: AttemptRun, status: int, broken: list[str]) -> None:
    """SPEC §3.4: the upstream acted, so the breach is unknown, never a release; its response
    is neither stored nor passed on."""
    log.warning(
        "job %s attempt %d on %s broke the contract (%d): %s",
        attempt.job.id,
        attempt.number,
        attempt.upstream,
        status,
        "contract: " + "; ".join(broken),
    )


async def _after_head(attempt: AttemptRun, storing: Awaitable[bool | None]) -> bool | None:
    """Store an outcome whose response is on its way to the client already (SPEC §7: one
    response per request): what the store said, or None when it could not be reached.

    A StoreUnavailable must not reach the handler: its 503 would follow the response on the
    same connection, and the next request on it (behind a pooling load balancer, maybe another
    client's) would read it as its answer. `_completed` and `settle` kept the outcome, and
    proxy/background/unwritten.py writes it once the store answers.
    """
    try:
        return await storing
    except StoreUnavailable:
        log.warning(
            "job %s attempt %d: outcome not stored after its response started; "
            "kept to write when the store answers",
            attempt.job.id,
            attempt.number,
        )
        return None


def _head_length(upstream: UpstreamResponse) -> HeaderPairs:
    """RFC 9110 §9.3.2, §8.6: a HEAD answer's Content-Length is that of the body a GET would
    get, not of its own (it has none), so it is not recomputed as every other one is (SPEC §7):
    the upstream's, for the first answer and, stored, for each replay."""
    if upstream.method == "HEAD" and upstream.content_length is not None:
        return ((hdrs.CONTENT_LENGTH, str(upstream.content_length)),)
    return ()


class KeptLease:
    """Renew the job's lease every third of its length until the block ends.

    If this process dies, renewals stop and the next request for the key takes the job over
    as `unknown` once the lease ran out by the database clock.

    Almost every attempt ends long before its first renewal is due, so the renewing task is
    only created when that moment comes: until then the block costs one timer.

    A renewal that fails (the store's timeout, a lock, a lost connection) is retried at once,
    each try bounded by the time the lease has left, so that one slow try does not let the lease
    run out under a healthy attempt. The time left is counted from when the statement that set
    the lease was sent (for the first one, from the start of this block), by this process's
    clock; the database's clock only started later, so the lease ends no sooner than that.
    Settings whose `pool.store_timeout` leaves no room for a try are refused at start-up
    (config/settings.py).
    """

    def __init__(self, store: JobStore, job: Job, *, lease: float) -> None:
        self._store = store
        self._job = job
        self._lease = lease
        self._granted = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._renewer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        self._granted = loop.time()
        self._timer = loop.call_later(self._lease / 3, self._start_renewing)

    async def __aexit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        renewer = self._renewer
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer

    def _start_renewing(self) -> None:
        self._renewer = asyncio.get_running_loop().create_task(
            _renew(self._store, self._job, self._lease, self._granted)
        )


async def _renew(store: JobStore, job: Job, lease: float, granted: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        renewed = await _renew_once(store, job, lease, expires=granted + lease)
        if renewed is None:
            return
        granted = renewed
        await asyncio.sleep(max(granted + lease / 3 - loop.time(), 0.0))


async def _renew_once(store: JobStore, job: Job, lease: float, *, expires: float) -> float | None:
    """Try until the store renews the lease: when the successful try was sent, or None when
    the lease is lost (taken over, or the job settled by another attempt)."""
    loop = asyncio.get_running_loop()
    delay = _FIRST_RETRY_SECONDS
    while True:
        sent = loop.time()
        left = expires - sent
        try:
            async with asyncio.timeout(try_bound(left)):
                renewed = await store.renew_lease(job, lease=lease)
        except (StoreUnavailable, TimeoutError):
            log.warning(
                "job %s: lease renewal failed, %.2fs of the lease left; retrying", job.id, left
            )
        else:
            if not renewed:
                log.warning("job %s: lease lost (taken over or settled elsewhere)", job.id)
                return None
            return sent
        await asyncio.sleep(min(delay, lease / 10))
        delay *= 2


def try_bound(left: float) -> float | None:
    """How long one renewal try may take: what is left of the lease, or only the store's own
    timeout once too little is left to bound it usefully."""
    return left if left >= _MIN_BOUNDED_TRY_SECONDS else None


def _names(trace: Trace, attempt: AttemptRun) -> None:
    """The request's log line names this attempt and its upstream together (SPEC §13)."""
    trace.upstream, trace.forwarded = attempt.upstream, attempt.number


Racing = dict["asyncio.Task[Step]", AttemptRun]
Ended = list[tuple[AttemptRun, HandedBack]]  # the racers that failed, in the order they ended


@dataclass(frozen=True, slots=True)
class Jobs:
    """Runs a claimed job's attempts (SPEC §2.2, §3.4) with the collaborators of one process,
    built once (`jobs_of`): its attempt runner and the runner of fail-overs and races."""

    attempts: AttemptRunner
    runner: JobRunner

    async def run(self, governed: GovernedRequest, claimed: Claimed) -> web.StreamResponse | None:
        """The client's response, or None when another attempt won: the caller re-reads the
        job."""
        route = governed.route
        if route.gate is None and not route.fallbacks:  # most routes: no call to `upstreams`
            upstreams: tuple[str, ...] = (route.upstream,)
        else:
            upstreams = route.upstreams  # the fallbacks eligible now (SPEC §3.4), for the job
        if len(upstreams) == 1:  # neither fail-over nor race: the attempt is final (Mode.FINAL)
            only = AttemptRun(claimed.job, claimed.attempt, upstreams[0])
            step = await self.attempts.run(governed, only)
            assert not isinstance(step, HandedBack), "a final attempt settles its job"
            return step
        if route.hedge_after is not None:
            return await self.runner.hedged(governed, claimed, upstreams, route.hedge_after)
        return await self.runner.in_order(governed, claimed, upstreams)


@dataclass(slots=True)
class JobRunner:
    """Runs the attempts of jobs with the collaborators of one process, given when built."""

    runner: AttemptRunner
    store: JobStore
    unsent: UnsentClaims
    # Racers run in tasks of their own: a loser keeps running after the client has its answer;
    # shutdown waits for them.
    attempts: set[asyncio.Task[Any]]
    lease: float

    async def in_order(
        self, governed: GovernedRequest, claimed: Claimed, upstreams: tuple[str, ...]
    ) -> web.StreamResponse | None:
        job, number = claimed.job, claimed.attempt
        state: Try | FailOver | RaceLost = Try(0, len(upstreams))
        failed: HandedBack | None = None
        while True:
            match state:
                case Try():
                    upstream = upstreams[state.index]
                    attempt = AttemptRun(job, number, upstream, state.mode)
                    step = await self.runner.run(governed, attempt)
                    if not isinstance(step, HandedBack):
                        return step
                    failed = step
                    log.info(
                        "job %s attempt %d on %s released (%s): failing over",
                        job.id,
                        number,
                        upstream,
                        step.error or step.status,
                    )
                    self.runner.count_failed(step.outcome)
                    state = state.next()
                case FailOver():
                    assert failed is not None
                    upstream = upstreams[state.index]
                    following = await self._fail_over(job, number, upstream, failed)
                    if following is not None:
                        job, number = following.job, following.attempt
                    state = state.next(following is not None)
                case RaceLost():
                    return None
                case _:
                    assert_never(state)

    async def _fail_over(
        self, job: Job, number: int, upstream: str, failed: HandedBack
    ) -> Claimed | None:
        """SPEC §3.4: attempt `number` proved nothing executed; the next one, on `upstream`.
        A failed call may still commit (its answer lost): nothing was forwarded under the
        attempt it started, so it is released once the store answers
        (proxy/background/unsent.py)."""
        token = new_job_id()  # a fresh UUID: the job's `started_by` if this statement commits
        try:
            return await self.store.fail_over(
                job,
                number,
                upstream,
                failure=AttemptFailure(failed.status, failed.error),
                lease=self.lease,
                token=token,
            )
        except (StoreUnavailable, asyncio.CancelledError):
            self.unsent.note_next(job, token)
            raise

    async def hedged(
        self,
        governed: GovernedRequest,
        claimed: Claimed,
        upstreams: tuple[str, ...],
        hedge_after: float,
    ) -> web.StreamResponse | None:
        job, racing, ended = claimed.job, Racing(), Ended()
        errors: list[StoreUnavailable] = []  # outcomes kept in the unwritten tracker
        self._race(governed, racing, AttemptRun(job, claimed.attempt, upstreams[0], Mode.HEDGED))
        race = Race(len(upstreams))
        state: RaceState = Wait(race, admitted=race.may_hedge())
        while True:
            match state:
                case Wait():
                    done, _ = await asyncio.wait(
                        racing,
                        timeout=hedge_after if state.admitted else None,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    winner, ends = _collect(racing, done, ended, errors)
                    if winner is not None:
                        _drop_replies(racing, ended)
                        return winner
                    state = state.next(ends)
                case AddHedge():
                    upstream = upstreams[state.race.started]
                    try:
                        number = await self.store.add_attempt(job, upstream, lease=self.lease)
                    except StoreUnavailable as error:
                        errors.append(error)
                        state = state.next(None)
                        continue
                    if number is not None:  # not once the job completed
                        self._race(governed, racing, AttemptRun(job, number, upstream, Mode.HEDGED))
                    state = state.next(number is not None)
                case RaceLost():
                    _drop_replies(racing, ended)  # nobody sends them now
                    return None  # another request's attempt won (a takeover): re-read the job
                case RaceStoreError():
                    _drop_replies(racing, ended)
                    raise errors[0]
                case SettleRace():
                    return await self._settle_race(governed, ended, state.index)
                case _:
                    assert_never(state)

    def _race(self, governed: GovernedRequest, racing: Racing, attempt: AttemptRun) -> None:
        task = asyncio.create_task(self._racer(governed, attempt))
        self.attempts.add(task)  # a loser keeps running after the client has its answer
        task.add_done_callback(self.attempts.discard)
        task.add_done_callback(_note_failure)
        racing[task] = attempt

    async def _racer(self, governed: GovernedRequest, attempt: AttemptRun) -> Step:
        """One attempt of the race; a failure is counted and recorded on the attempt (also after
        another racer won: a late 503 or timeout must not leave it `started`), the job is left
        alone."""
        step = await self.runner.run(governed, attempt)
        if type(step) is HandedBack:
            self.runner.count_failed(step.outcome)
            await self.store.finish_attempt(
                attempt.job,
                attempt.number,
                settled_state(step.outcome),
                status=step.status,
                error=step.error,
            )
        return step

    async def _settle_race(
        self, governed: GovernedRequest, ended: Ended, index: int
    ) -> web.StreamResponse | None:
        """No racer completed: the job is unknown if any attempt may have executed, else
        released (the machine chose which failure settles it). None when the job was decided
        elsewhere meanwhile (a takeover after the lease ran out): the caller re-reads it, as
        after a fail-over that lost its CAS, and answers from what it is now."""
        attempt, handed = ended[index]
        failed = Failed(handed.outcome, handed.status, handed.error, handed.problem)
        # Every attempt's own end is recorded already; this settles the job.
        settled = await self.store.settle(
            attempt.job,
            attempt.number,
            settled_state(failed.outcome),
            status=failed.status,
            error=failed.error,
        )
        for _, other in ended:
            if other is not handed:
                drop_unsent(other.reply)
        if not settled:
            log.info("job %s attempt %d: settle lost the CAS", attempt.job.id, attempt.number)
            drop_unsent(handed.reply)
            return None
        if handed.reply is not None:  # SPEC §3.2: the upstream's own answer, e.g. its 503
            return handed.reply
        return self.runner.problem(attempt, failed)


def _collect(
    racing: Racing, done: set[asyncio.Task[Step]], ended: Ended, errors: list[StoreUnavailable]
) -> tuple[web.StreamResponse | None, tuple[RacerEnd, ...]]:
    """The winner's response, if it is among `done`, and how the others ended."""
    winner, ends = None, []
    for task in done:
        attempt = racing.pop(task)
        try:
            step = task.result()
        except StoreUnavailable as error:
            errors.append(error)
            ends.append(RacerEnd.STORE_ERROR)
            continue
        match step:
            case HandedBack():
                ended.append((attempt, step))  # counted and recorded by the racer
                ends.append(racer_end(step.outcome))
            case None:
                ends.append(RacerEnd.LOST)
            case web.StreamResponse():
                winner = step
            case _:
                assert_never(step)
    return winner, tuple(ends)


def _drop_replies(racing: Racing, ended: Ended) -> None:
    """The race is answered: the upstream replies kept by its failed racers, and by those still
    running, are never sent; each gives back what it holds now (proxy/server/capture.py)."""
    for _, failed in ended:
        drop_unsent(failed.reply)
    for task in racing:
        task.add_done_callback(_drop_reply)


def _drop_reply(task: asyncio.Task[Step]) -> None:
    if not task.cancelled() and task.exception() is None:
        step = task.result()
        drop_unsent(step.reply if isinstance(step, HandedBack) else None)


def _note_failure(task: asyncio.Task[Step]) -> None:
    """A loser may fail after the race returned, and nobody reads its result then: asyncio
    would log each such store error as a traceback at ERROR ("never retrieved")."""
    if task.cancelled() or (error := task.exception()) is None:
        return
    if isinstance(error, StoreUnavailable):  # the outcome is in the unwritten tracker already
        log.info("hedged attempt could not reach the store: %s", error)
    else:
        log.error("hedged attempt failed", exc_info=error)


class AttemptObserver:
    """What an attempt's steps tell besides the request's record, its metrics and its log
    lines: with tracing off, nothing (each step's awaitable goes through as it is)."""

    __slots__ = ()

    def forwarding(
        self,
        method: str,
        url: URL,
        headers: CIMultiDict[str],
        ids: tuple[str, int],
        forwarding: Awaitable[Step],
    ) -> Awaitable[Step]:
        """The attempt `ids` (job, number) about to send `headers` upstream."""
        return forwarding

    def upstream_failed(self, reason: str, outcome: Outcome) -> None:
        """No (whole) answer came back, for `reason`; what that makes of the attempt."""

    def completing(self, job_id: str, number: int, completing: Awaitable[bool]) -> Awaitable[bool]:
        """The completion CAS of an attempt (SPEC §1), about to be awaited."""
        return completing

    def settling(
        self, job_id: str, number: int, state: JobState, settling: Awaitable[bool]
    ) -> Awaitable[bool]:
        """An attempt's failure written as `state`, about to be awaited."""
        return settling


class TracedAttemptObserver(AttemptObserver):
    """As `AttemptObserver`, and each step's span (proxy/tracing.py)."""

    __slots__ = ("_tracing",)

    def __init__(self, tracing: Tracing) -> None:
        self._tracing = tracing

    def forwarding(
        self,
        method: str,
        url: URL,
        headers: CIMultiDict[str],
        ids: tuple[str, int],
        forwarding: Awaitable[Step],
    ) -> Awaitable[Step]:
        return self._tracing.attempt(method, url, headers, ids, forwarding)

    def upstream_failed(self, reason: str, outcome: Outcome) -> None:
        self._tracing.upstream_failed(reason, outcome)

    def completing(self, job_id: str, number: int, completing: Awaitable[bool]) -> Awaitable[bool]:
        return self._tracing.complete(job_id, number, completing)

    def settling(
        self, job_id: str, number: int, state: JobState, settling: Awaitable[bool]
    ) -> Awaitable[bool]:
        return self._tracing.settle(job_id, number, state, settling)


UNTRACED = AttemptObserver()


def attempt_observer(tracing: Tracing | None) -> AttemptObserver:
    """The observer of an attempt: with spans only when tracing is on."""
    return UNTRACED if tracing is None else TracedAttemptObserver(tracing)
