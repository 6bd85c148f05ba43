"""Asking backends about `unknown` jobs in the background (SPEC §3.6).

On a route with a `resolve.reconcile` endpoint, every proxy looks every `interval` seconds for
`unknown` jobs whose attempt is due a question (its backoff counted by the database clock),
wins the right to ask by a compare-and-swap on the attempt's question count (`Store.claim_check`:
of the replicas that find it due at once, one asks), asks, keeps the question and its answer on
the attempt as evidence, and resolves the job by the same compare-and-swap on its version that
an operator's resolution is (`Store.resolve`, resolution `reconcile`): an operator's resolution
made meanwhile wins, and so does another replica's. An answer that proves nothing leaves the
job `unknown`, to be asked again after a longer wait.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from prometheus_client import Counter

from idemproxy.config.resolve import ReconcileSettings
from idemproxy.config.settings import Settings
from idemproxy.constants import MAX_EVIDENCE_DETAIL, RESOLUTION_RECONCILE
from idemproxy.core.resolution import (
    Backoff,
    Question,
    Reading,
    Verdict,
    Way,
    asked_attempts,
    never_executed,
    read_reconcile_answer,
    releasable,
)
from idemproxy.core.types import Attempt, AttemptState, Evidence, Job, JobState
from idemproxy.errors import InvalidRequest, StoreUnavailable
from idemproxy.ops.resolution import ResponseRules, completed
from idemproxy.ops.service import resolution_ttl
from idemproxy.proxy.background.ask import Answered, ReconcileClient
from idemproxy.proxy.background.endpoints import Endpoint, Endpoints, endpoints
from idemproxy.proxy.upstream.client import UpstreamClient
from idemproxy.store.base import Store

log = logging.getLogger(__name__)
_ANSWER_OVERHEAD = 256 * 1024
# The cursor of a pass's first page: below every job id (a UUID's text).
_BEFORE_EVERY_ID = "00000000-0000-0000-0000-000000000000"


class Result(enum.StrEnum):
    """What one question did to its job (the `result` label of `idemproxy_resolutions_total`)."""

    COMPLETED = "completed"
    RELEASED = "released"
    UNKNOWN = "unknown"  # the answer proved nothing: asked again later
    LOST = "lost"  # resolved otherwise meanwhile (an operator, another replica)


class Reconciler:
    def __init__(
        self,
        store: Store,
        client: ReconcileClient,
        known: Endpoints,
        rules: ResponseRules,
        on_result: Callable[[Result], None] | None = None,
    ) -> None:
        self._store = store
        self._client = client
        self._endpoints = known
        self._rules = rules
        self._on_result = on_result
        # Due under every endpoint's backoff is due under this one: the store lists a superset
        # of the jobs due a question, and `claim_check` holds each to its own route's backoff.
        self._loosest = Backoff(
            min((e.reconcile.backoff for e in known.declared), default=0.0),
            min((e.reconcile.max_backoff for e in known.declared), default=0.0),
            min((e.reconcile.timeout for e in known.declared), default=0.0),
        )

    def covers(self, job: Job) -> bool:
        """Whether a reconcile endpoint may answer for `job` (by its path: cheap, no read)."""
        return self._endpoints.may_cover(job.path)

    async def for_retry(self, job: Job, asked_on: Endpoint) -> datetime | None:
        """SPEC §3.6: a retry of `job` asks about it too, at `asked_on`, the endpoint of the
        route the retry took, if a question is due. Then, if the job is still `unknown`, when
        the next question is due (None: resolved meanwhile, or none will be asked)."""
        await self.reconcile(job.id, asked_on)
        found = await self._store.get_by_id(job.id)
        if found is None or found.state is not JobState.UNKNOWN:
            return None
        return self._next_due(found, asked_on)

    def _next_due(self, job: Job, asked_on: Endpoint | None) -> datetime | None:
        """When the first of the questions about `job`'s unknown attempts is next due."""
        due = []
        for attempt in asked_attempts(job):
            endpoint = self._endpoint(job, attempt, asked_on)
            last = attempt.checked_at or attempt.finished_at or attempt.started_at
            if endpoint is not None and last is not None:
                wait = _due_after(endpoint.reconcile, attempt.checks)
                due.append(last + timedelta(seconds=wait))
        return min(due, default=None)

    async def run_pass(self, batch_size: int) -> list[Result]:
        """Ask about every `unknown` job that is due a question, read `batch_size` at a time:
        jobs no answer resolves (or on routes without an endpoint) never keep others waiting."""
        results: list[Result] = []
        after = _BEFORE_EVERY_ID
        while True:
            page = await self._store.due_unknown(self._loosest, after=after, limit=batch_size)
            for job in page:
                if self.covers(job):
                    result = await self.reconcile(job.id)
                    if result is not None:
                        results.append(result)
            if len(page) < batch_size:
                return results
            after = page[-1].id

    async def reconcile(self, job_id: str, asked_on: Endpoint | None = None) -> Result | None:
        """A question about each unknown attempt of job `job_id` that is due one and this
        process wins the right to ask about, until an answer resolves the job; the result of
        the last question asked, None when none was. `asked_on`: a retry's endpoint
        (`_endpoint`)."""
        job = await self._store.get_by_id(job_id)
        if job is None or job.state is not JobState.UNKNOWN:
            return None
        # SPEC §3.6: any unknown attempt may be the one that executed; "never executed" about
        # all of them (each answer kept on its attempt) is what releases the job.
        never = set(never_executed(job))
        result = None
        for attempt in asked_attempts(job):
            endpoint = self._endpoint(job, attempt, asked_on)
            if endpoint is None:
                continue
            reading = await self._ask(job, attempt, endpoint, never)
            if reading is None:
                continue
            result = await self._settle(job, reading, endpoint, frozenset(never))
            log.info("job %s: reconcile said %s about attempt %d (%s): %s", job.id,
                     reading.verdict.value, attempt.number, reading.reason,
                     result.value)  # fmt: skip
            if self._on_result is not None:
                self._on_result(result)
            if result is not Result.UNKNOWN:
                return result
        return result

    async def _ask(
        self, job: Job, attempt: Attempt, endpoint: Endpoint, never: set[int]
    ) -> Reading | None:
        """One question about `attempt`, if it is due and this process wins the right to ask
        it, kept as evidence on it; a "never executed" joins `never`."""
        settings = endpoint.reconcile
        due = _due_after(settings, attempt.checks)
        if not await self._store.claim_check(job, attempt.number, checks=attempt.checks,
                                             due_after=due):  # fmt: skip
            return None
        question = Question(job.id, job.key, attempt.number, job.method, job.path)
        edits = endpoint.edits.get(attempt.upstream, ())
        answered = await self._client.ask(settings, question, edits)
        reading = self._read(question, answered)
        if reading.verdict is Verdict.NOT_EXECUTED:
            never.add(attempt.number)
            if attempt.state is AttemptState.DISCARDED:
                # SPEC §3.6: its upstream answered it, too late to count: no release.
                why = "never executed, but its upstream answered it (a late answer is kept)"
                reading = Reading(Verdict.NOT_EXECUTED, why)
            elif not releasable(job, frozenset(never)):
                why = "never executed, but another attempt may have"
                reading = Reading(Verdict.NOT_EXECUTED, why)
        await self._store.record_evidence(job, attempt.number, _evidence(answered, reading))
        return reading

    def _endpoint(self, job: Job, attempt: Attempt, asked_on: Endpoint | None) -> Endpoint | None:
        """SPEC §3.6: the endpoint of the route a retry took (`asked_on`), or else of the route
        the job took, if that can be told (proxy/background/endpoints.py); and only if it
        vouches for the attempt's upstream."""
        endpoint = asked_on
        if endpoint is None:
            endpoint = self._endpoints.for_job(job.path, attempt.upstream)
        return endpoint if endpoint is not None and endpoint.vouches_for(attempt.upstream) else None

    def _read(self, question: Question, answered: Answered) -> Reading:
        if answered.status is None:
            return Reading(Verdict.UNKNOWN, answered.error or "no answer")
        reading = read_reconcile_answer(question, answered.status, answered.body)
        if reading.response is None:
            return reading
        # Replayed to every client of the job: held to what an operator's may be (§3.3), and
        # stored as one is.
        given = reading.response
        try:
            checked = completed(given.status, given.headers, given.body or b"", self._rules)
        except InvalidRequest as refused:
            return Reading(Verdict.UNKNOWN, f"executed, but not replayable: {refused}")
        return Reading(Verdict.EXECUTED, reading.reason, checked.response)

    async def _settle(
        self, job: Job, reading: Reading, endpoint: Endpoint, never: frozenset[int]
    ) -> Result:
        match reading.verdict:
            case Verdict.EXECUTED:
                ttl = resolution_ttl(job, endpoint.ttl)
                won = await self._store.resolve(
                    job,
                    JobState.COMPLETED,
                    response=reading.response,
                    ttl=ttl,
                    resolution=RESOLUTION_RECONCILE,
                )
                return Result.COMPLETED if won else Result.LOST
            case Verdict.NOT_EXECUTED if releasable(job, never):
                won = await self._store.resolve(
                    job, JobState.RELEASED, resolution=RESOLUTION_RECONCILE
                )
                return Result.RELEASED if won else Result.LOST
            case _:
                return Result.UNKNOWN


def _due_after(settings: ReconcileSettings, checks: int) -> float:
    return Backoff(settings.backoff, settings.max_backoff, settings.timeout).due_after(checks)


def _evidence(answered: Answered, reading: Reading) -> Evidence:
    return Evidence(
        way=Way.RECONCILE.value,
        asked_at=answered.asked_at,
        answered_at=answered.answered_at,
        status=answered.status,
        verdict=reading.verdict.value,
        reason=reading.reason[:MAX_EVIDENCE_DETAIL],
    )


def start_reconciling(
    settings: Settings, store: Store, upstream: UpstreamClient, counter: Counter
) -> tuple[Reconciler | None, list[asyncio.Task[None]]]:
    """The reconciler and its background task, if any route names a reconcile endpoint; it
    asks through `upstream`, the process's upstream client. `counter`:
    `idemproxy_resolutions_total`."""
    known = endpoints(settings)
    if not known:
        return None, []
    # A response of up to max_stored_body, base64-coded in JSON, with room for its headers.
    client = ReconcileClient(upstream, settings.max_stored_body * 4 // 3 + _ANSWER_OVERHEAD)

    def counted(result: Result) -> None:
        counter.labels(Way.RECONCILE.value, result.value).inc()

    reconciler = Reconciler(store, client, known, ResponseRules.from_settings(settings), counted)
    sweeper = settings.sweeper
    running = reconcile_forever(
        reconciler, interval=sweeper.reconcile_interval, batch_size=sweeper.batch_size
    )
    return reconciler, [asyncio.create_task(running)]


async def reconcile_forever(reconciler: Reconciler, *, interval: float, batch_size: int) -> None:
    """Every `interval` seconds, one pass; a failed pass is logged and the next one runs."""
    while True:
        await asyncio.sleep(interval)
        try:
            await reconciler.run_pass(batch_size)
        except StoreUnavailable:
            log.warning("reconcile: store unavailable; will retry in %.1fs", interval)
        except Exception:
            # Like the sweeper: one bad pass must not end the task for good.
            log.exception("reconcile: unexpected error; will retry in %.1fs", interval)
