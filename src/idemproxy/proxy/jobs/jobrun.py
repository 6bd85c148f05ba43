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
from typing import assert_never

from aiohttp import web

from idemproxy.core.attempts import (
    Mode,
    RaceEnd,
    brings_in_next,
    may_hedge,
    none_executed,
    order_mode,
    race_end,
    settled_state,
    settling_index,
)
from idemproxy.core.types import Claimed, Job
from idemproxy.errors import StoreUnavailable
from idemproxy.http.problems import problem_response
from idemproxy.identity.ids import new_job_id
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.jobs.attempt import AttemptRun, Failed, Step, count_failed, run_attempt
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.server.capture import drop_unsent
from idemproxy.store.base import AttemptFailure

log = logging.getLogger(__name__)
Racing = dict["asyncio.Task[Step]", AttemptRun]


async def run_job(governed: GovernedRequest, claimed: Claimed) -> web.StreamResponse | None:
    """The client's response, or None when another attempt won: the caller re-reads the job."""
    route = governed.route
    upstreams = route.upstreams  # the fallbacks eligible now (SPEC §3.4), for the whole job
    if route.hedge_after is not None and len(upstreams) > 1:
        return await _run_hedged(governed, claimed, upstreams, route.hedge_after)
    return await _run_in_order(governed, claimed, upstreams)


async def _run_in_order(
    governed: GovernedRequest, claimed: Claimed, upstreams: tuple[str, ...]
) -> web.StreamResponse | None:
    ctx = governed.ctx
    job, number = claimed.job, claimed.attempt
    for index, upstream in enumerate(upstreams):
        attempt = AttemptRun(job, number, upstream, order_mode(index, len(upstreams)))
        step = await run_attempt(governed, attempt)
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
        following = await _fail_over(ctx, job, number, upstreams[index + 1], step)
        if following is None:
            return None
        job, number = following.job, following.attempt
    raise AssertionError("the last upstream runs in FINAL mode and never hands back")


async def _fail_over(
    ctx: ProxyContext, job: Job, number: int, upstream: str, failed: Failed
) -> Claimed | None:
    """SPEC §3.4: attempt `number` proved nothing executed; the next one, on `upstream`. A failed
    call may still commit (its answer lost): nothing was forwarded under the attempt it started,
    so it is released once the store answers (proxy/background/unsent.py)."""
    token = new_job_id()  # a fresh UUID: the job's `started_by` if this statement commits
    try:
        return await ctx.store.fail_over(
            job,
            number,
            upstream,
            failure=AttemptFailure(failed.status, failed.error),
            lease=ctx.settings.lease,
            token=token,
        )
    except (StoreUnavailable, asyncio.CancelledError):
        ctx.unsent.note_next(job, token)
        raise


@dataclass
class _Race:
    """The racers of one hedged request, and what the finished ones left."""

    racing: Racing = field(default_factory=dict)
    failures: list[tuple[AttemptRun, Failed]] = field(default_factory=list)
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
            match step:
                case Failed():
                    self.failures.append((attempt, step))  # counted and recorded by the racer
                case None:
                    # The CAS winner may be a racer of this very request, still streaming its
                    # body to this client: a replay now would be a second response in the
                    # middle of that body (SPEC §7, one response per request). Wait for it.
                    self.lost = True
                case web.StreamResponse():
                    winner = step
                case _:
                    assert_never(step)
        return winner

    def none_executed(self) -> bool:
        """SPEC §3.4: once any racer may have executed, no further upstream is brought in,
        neither as a fail-over (every racer failed) nor by the hedge timer."""
        outcomes = (failed.outcome for _, failed in self.failures)
        return none_executed(outcomes, store_errors=bool(self.errors))


async def _run_hedged(
    governed: GovernedRequest, claimed: Claimed, upstreams: tuple[str, ...], hedge_after: float
) -> web.StreamResponse | None:
    job, race = claimed.job, _Race()
    _race(governed, race.racing, AttemptRun(job, claimed.attempt, upstreams[0], Mode.HEDGED))
    waiting_for = 1
    while race.racing:
        more = may_hedge(
            started=waiting_for,
            upstreams=len(upstreams),
            lost=race.lost,
            none_executed=race.none_executed(),
        )
        done, _ = await asyncio.wait(
            race.racing,
            timeout=hedge_after if more else None,
            return_when=asyncio.FIRST_COMPLETED,
        )
        winner = race.collect(done)
        if winner is not None:
            _drop_replies(race)
            return winner
        if brings_in_next(
            admitted=more,
            none_executed=race.none_executed(),
            timed_out=not done,
            racing=bool(race.racing),
        ):
            try:
                await _hedge(governed, race.racing, job, upstreams[waiting_for])
            except StoreUnavailable as error:
                if not race.racing:
                    raise
                # A racer may be streaming its answer to this client: no 503 in its middle.
                race.errors.append(error)
                waiting_for = len(upstreams)
            waiting_for += 1
    return await _without_winner(governed.ctx, race)


async def _without_winner(ctx: ProxyContext, race: _Race) -> web.StreamResponse | None:
    end = race_end(lost=race.lost, store_errors=bool(race.errors))
    match end:
        case RaceEnd.LOST:
            _drop_replies(race)  # nobody sends them now
            return None  # the winner was another request's attempt (a takeover): re-read the job
        case RaceEnd.STORE_ERROR:
            _drop_replies(race)
            raise race.errors[0]
        case RaceEnd.ALL_FAILED:
            return await _all_failed(ctx, race.failures)
        case _:
            assert_never(end)


async def _hedge(governed: GovernedRequest, racing: Racing, job: Job, upstream: str) -> None:
    """One more racer on `upstream`, unless the job stopped taking attempts (it completed)."""
    ctx = governed.ctx
    number = await ctx.store.add_attempt(job, upstream, lease=ctx.settings.lease)
    if number is not None:
        _race(governed, racing, AttemptRun(job, number, upstream, Mode.HEDGED))


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


def _race(governed: GovernedRequest, racing: Racing, attempt: AttemptRun) -> None:
    ctx = governed.ctx
    task = asyncio.create_task(_racer(governed, attempt))
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


async def _racer(governed: GovernedRequest, attempt: AttemptRun) -> Step:
    """One attempt of the race; a failure is counted and recorded on the attempt (also after
    another racer won: a late 503 or timeout must not leave it `started`), the job is left
    alone."""
    ctx = governed.ctx
    step = await run_attempt(governed, attempt)
    if isinstance(step, Failed):
        count_failed(ctx, step)
        await ctx.store.finish_attempt(
            attempt.job,
            attempt.number,
            settled_state(step.outcome),
            status=step.status,
            error=step.error,
        )
    return step


async def _all_failed(
    ctx: ProxyContext, failures: list[tuple[AttemptRun, Failed]]
) -> web.StreamResponse | None:
    """No racer completed: the job is unknown if any attempt may have executed, else released."""
    attempt, failed = failures[settling_index([failed.outcome for _, failed in failures])]
    # Every attempt's own end is recorded already; this settles the job.
    await ctx.store.settle(
        attempt.job,
        attempt.number,
        settled_state(failed.outcome),
        status=failed.status,
        error=failed.error,
    )
    for _, other in failures:
        if other is not failed:
            drop_unsent(other.reply)
    if failed.reply is not None:  # SPEC §3.2: the upstream's own answer, e.g. its 503
        return failed.reply
    problem = failed.problem().about(attempt.job.id, settled_state(failed.outcome).value)
    return problem_response(problem, profile=ctx.settings.profile, types=ctx.settings.problem_types)
