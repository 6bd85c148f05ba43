"""Running a job's attempts across an upstream group: the driver of core/attempt_order.py
(SPEC §3.4).

In order: the primary, then each fallback while the outcome proves nothing executed (released),
every try a new attempt under the same job. Hedged (`hedge_after`): after that delay with no
answer, one more attempt starts on the next upstream; the first attempt to complete wins the
CAS and the others' results are discarded and recorded. The machine keeps the race's
bookkeeping; this driver owns the tasks, the hedge timer and the responses.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, assert_never

from aiohttp import web

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
from idemproxy.core.attempts import Failed, Mode, settled_state
from idemproxy.core.types import Claimed, Job
from idemproxy.errors import StoreUnavailable
from idemproxy.identity.ids import new_job_id
from idemproxy.proxy.jobs.attempt import AttemptRun, AttemptRunner, HandedBack, Step
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.server.capture import drop_unsent
from idemproxy.store.base import AttemptFailure

if TYPE_CHECKING:
    from idemproxy.proxy.background.unsent import UnsentClaims
    from idemproxy.store.ports import JobStore

log = logging.getLogger(__name__)
Racing = dict["asyncio.Task[Step]", AttemptRun]
Ended = list[tuple[AttemptRun, HandedBack]]  # the racers that failed, in the order they ended


async def run_job(governed: GovernedRequest, claimed: Claimed) -> web.StreamResponse | None:
    """The client's response, or None when another attempt won: the caller re-reads the job."""
    ctx, route = governed.ctx, governed.route
    attempts = AttemptRunner(
        ctx.settings, ctx.store, ctx.upstream, ctx.statuses, ctx.budget, ctx.unwritten,
        ctx.metrics, ctx.failpoints, ctx.tracing,
    )  # fmt: skip
    if route.gate is None and not route.fallbacks:  # most routes: no call to `upstreams`
        upstreams: tuple[str, ...] = (route.upstream,)
    else:
        upstreams = route.upstreams  # the fallbacks eligible now (SPEC §3.4), for the whole job
    if len(upstreams) == 1:  # neither fail-over nor race: the attempt is final (Mode.FINAL)
        only = AttemptRun(claimed.job, claimed.attempt, upstreams[0])
        step = await attempts.run(governed, only)
        assert not isinstance(step, HandedBack), "a final attempt settles its job"
        return step
    runner = JobRunner(attempts, ctx.store, ctx.unsent, ctx.attempts, ctx.settings.lease)
    if route.hedge_after is not None:
        return await runner.hedged(governed, claimed, upstreams, route.hedge_after)
    return await runner.in_order(governed, claimed, upstreams)


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
