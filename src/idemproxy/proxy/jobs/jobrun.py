"""Running a job's attempts across an upstream group (SPEC §3.4).

In order: the primary, then each fallback while the outcome proves nothing executed (released),
every try a new attempt under the same job. Hedged (`hedge_after`): after that delay with no
answer, one more attempt starts on the next upstream; the first attempt to complete wins the
CAS and the others' results are discarded and recorded.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web

from idemproxy.core.decision import Outcome, race_outcome
from idemproxy.core.types import Claimed, Job
from idemproxy.errors import StoreUnavailable
from idemproxy.http.problems import problem_response
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.jobs.attempt import (
    SETTLED_STATE,
    Attempt,
    Failed,
    Mode,
    Step,
    count_failed,
    run_attempt,
)
from idemproxy.proxy.routing import Route
from idemproxy.proxy.server.body import RequestBody
from idemproxy.proxy.server.capture import drop_unsent
from idemproxy.store.base import AttemptFailure

log = logging.getLogger(__name__)
Racing = dict["asyncio.Task[Step]", Attempt]


async def run_job(
    ctx: ProxyContext, request: web.Request, route: Route, claimed: Claimed, body: RequestBody
) -> web.StreamResponse | None:
    """The client's response, or None when another attempt won: the caller re-reads the job."""
    upstreams = route.upstreams
    if route.hedge_after is not None and len(upstreams) > 1:
        return await _run_hedged(ctx, request, route, claimed, body, upstreams)
    return await _run_in_order(ctx, request, route, claimed, body, upstreams)


async def _run_in_order(
    ctx: ProxyContext,
    request: web.Request,
    route: Route,
    claimed: Claimed,
    body: RequestBody,
    upstreams: tuple[str, ...],
) -> web.StreamResponse | None:
    job, number = claimed.job, claimed.attempt
    for index, upstream in enumerate(upstreams):
        mode = Mode.FINAL if index == len(upstreams) - 1 else Mode.FAIL_OVER
        step = await run_attempt(ctx, request, route, Attempt(job, number, upstream, mode), body)
        if not isinstance(step, Failed):
            return step
        log.info(
            "job %s attempt %d on %s released (%s): failing over",
            job.id,
            number,
            upstream,
            step.error or step.status,
        )
        count_failed(ctx, step)
        following = await ctx.store.fail_over(
            job,
            number,
            upstreams[index + 1],
            failure=AttemptFailure(step.status, step.error),
            lease=ctx.settings.lease,
        )
        if following is None:
            return None
        job, number = following.job, following.attempt
    raise AssertionError("the last upstream runs in FINAL mode and never hands back")


@dataclass
class _Race:
    """The racers of one hedged request, and what the finished ones left."""

    racing: Racing = field(default_factory=dict)
    failures: list[tuple[Attempt, Failed]] = field(default_factory=list)
    errors: list[StoreUnavailable] = field(default_factory=list)  # outcomes in ctx.unwritten
    lost: bool = False  # an attempt lost the completion CAS: another one completed the job

    def collect(self, done: set[asyncio.Task[Step]]) -> web.StreamResponse | None:
        """The winner's response, if it is among `done`."""
        winner = None
        for task in done:
            attempt = self.racing.pop(task)
            try:
                step = task.result()
            except StoreUnavailable as error:
                self.errors.append(error)
                continue
            if isinstance(step, Failed):
                self.failures.append((attempt, step))  # counted and recorded by the racer
            elif step is None:
                # The CAS winner may be a racer of this very request, still streaming its
                # body to this client: a replay now would be a second response in the middle
                # of that body (SPEC §7, one response per request). Wait for the winner.
                self.lost = True
            else:
                winner = step
        return winner

    def none_executed(self) -> bool:
        """SPEC §3.4: once any racer may have executed, no further upstream is brought in,
        neither as a fail-over (every racer failed) nor by the hedge timer. A racer that ended
        with a store error (its outcome not written, or its answer not stored) is one whose
        outcome the race does not know: it may have executed."""
        return not self.errors and _none_executed(self.failures)


async def _run_hedged(
    ctx: ProxyContext,
    request: web.Request,
    route: Route,
    claimed: Claimed,
    body: RequestBody,
    upstreams: tuple[str, ...],
) -> web.StreamResponse | None:
    assert route.hedge_after is not None
    job, race = claimed.job, _Race()
    first = Attempt(job, claimed.attempt, upstreams[0], Mode.HEDGED)
    _race(ctx, request, route, body, race.racing, first)
    waiting_for = 1
    while race.racing:
        more = waiting_for < len(upstreams) and not race.lost and race.none_executed()
        done, _ = await asyncio.wait(
            race.racing,
            timeout=route.hedge_after if more else None,
            return_when=asyncio.FIRST_COMPLETED,
        )
        winner = race.collect(done)
        if winner is not None:
            _drop_replies(race)
            return winner
        if more and race.none_executed() and (not done or not race.racing):
            # No answer within hedge_after, or every racer failed (each proved nothing executed,
            # none_executed): bring in the next upstream.
            try:
                await _hedge(ctx, request, route, body, race.racing, job, upstreams[waiting_for])
            except StoreUnavailable as error:
                if not race.racing:
                    raise
                # A racer may be streaming its answer to this client: no 503 in its middle.
                race.errors.append(error)
                waiting_for = len(upstreams)
            waiting_for += 1
    if race.lost or race.errors:
        _drop_replies(race)  # nobody sends them now
    if race.lost:
        return None  # the winner was another request's attempt (a takeover): re-read the job
    if race.errors:
        raise race.errors[0]
    return await _all_failed(ctx, race.failures)


async def _hedge(
    ctx: ProxyContext,
    request: web.Request,
    route: Route,
    body: RequestBody,
    racing: Racing,
    job: Job,
    upstream: str,
) -> None:
    """One more racer on `upstream`, unless the job stopped taking attempts (it completed)."""
    number = await ctx.store.add_attempt(job, upstream, lease=ctx.settings.lease)
    if number is not None:
        _race(ctx, request, route, body, racing, Attempt(job, number, upstream, Mode.HEDGED))


def _drop_replies(race: _Race) -> None:
    """The race is answered: the upstream replies kept by its failed racers, and by those still
    running, are never sent; each gives back what it holds now (proxy/server/capture.py)."""
    for _, failed in race.failures:
        drop_unsent(failed.reply)
    for task in race.racing:
        task.add_done_callback(_drop_reply)


def _drop_reply(task: asyncio.Task[Step]) -> None:
    if not task.cancelled() and task.exception() is None:
        step = task.result()
        drop_unsent(step.reply if isinstance(step, Failed) else None)


def _none_executed(failures: list[tuple[Attempt, Failed]]) -> bool:
    """Every failed racer was released: none of them may have executed (SPEC §3.2)."""
    return race_outcome(failed.outcome for _, failed in failures) is Outcome.RELEASE


def _race(
    ctx: ProxyContext,
    request: web.Request,
    route: Route,
    body: RequestBody,
    racing: Racing,
    attempt: Attempt,
) -> None:
    task = asyncio.create_task(_racer(ctx, request, route, body, attempt))
    ctx.attempts.add(task)  # a loser keeps running after the client has its answer
    task.add_done_callback(ctx.attempts.discard)
    task.add_done_callback(_note_failure)
    racing[task] = attempt


def _note_failure(task: asyncio.Task[Step]) -> None:
    """A loser may fail after the race returned, and nobody reads its result then: asyncio
    would log each such store error as a traceback at ERROR ("never retrieved")."""
    if task.cancelled() or (error := task.exception()) is None:
        return
    if isinstance(error, StoreUnavailable):  # the outcome is in ctx.unwritten already
        log.info("hedged attempt could not reach the store: %s", error)
    else:
        log.error("hedged attempt failed", exc_info=error)


async def _racer(
    ctx: ProxyContext, request: web.Request, route: Route, body: RequestBody, attempt: Attempt
) -> Step:
    """One attempt of the race; a failure is counted and recorded on the attempt, the job is
    left alone.

    FIX: failures used to be recorded by `_run_hedged` only while it was still waiting, so a
    racer that failed after another had won (a late 503, a timeout) stayed `started` for ever.
    """
    step = await run_attempt(ctx, request, route, attempt, body)
    if isinstance(step, Failed):
        count_failed(ctx, step)
        await ctx.store.finish_attempt(
            attempt.job,
            attempt.number,
            SETTLED_STATE[step.outcome],
            status=step.status,
            error=step.error,
        )
    return step


async def _all_failed(
    ctx: ProxyContext, failures: list[tuple[Attempt, Failed]]
) -> web.StreamResponse | None:
    """No racer completed: the job is unknown if any attempt may have executed, else released."""
    unknown = [(a, f) for a, f in failures if f.outcome is Outcome.UNKNOWN]
    attempt, failed = (unknown or failures)[-1]
    # Every attempt's own end is recorded already; this settles the job.
    await ctx.store.settle(
        attempt.job,
        attempt.number,
        SETTLED_STATE[failed.outcome],
        status=failed.status,
        error=failed.error,
    )
    for _, other in failures:
        if other is not failed:
            drop_unsent(other.reply)
    if failed.reply is not None:  # SPEC §3.2: the upstream's own answer, e.g. its 503
        return failed.reply
    return problem_response(failed.problem(), profile=ctx.settings.profile)
