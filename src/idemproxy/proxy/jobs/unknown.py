"""The I/O of core/machine.py's states about an `unknown` job that may resolve itself (SPEC §3.6):
`NeedResend` and `NeedAsk`, carried out for the driver (proxy/jobs/governed.py).

* On a route whose upstream honours the key, the request is sent again under it as a new
  attempt, when core/resolution.py `may_resend` allows it: one retry wins the store's CAS, and
  the upstream's final answer completes the job (a `Resent` claim, run by `run_claimed`).
* On a route with a reconcile endpoint, the backend is asked (if a question is due), and a job
  still unknown says when the next question is due (Retry-After, `next_check_at`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from aiohttp import web

from idemproxy.core.machine import Mode
from idemproxy.core.resolution import (
    Resend,
    ResendAsk,
    Way,
    first_sent,
    may_resend,
    read_resend_answer,
)
from idemproxy.core.types import Claimed, Evidence, Job
from idemproxy.errors import OutcomeUnknown, ProblemError, StoreUnavailable
from idemproxy.identity.intent import new_job_id
from idemproxy.proxy.background.endpoints import Endpoint
from idemproxy.proxy.jobs.jobrun import AttemptRun, HandedBack, Jobs
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.resending import sent_digest
from idemproxy.proxy.routing import Route
from idemproxy.store.ports import JobStore

if TYPE_CHECKING:
    from idemproxy.proxy.background.reconcile import Reconciler

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Resent(Claimed):
    """A claim of the attempt that sends an `unknown` job's request again, on `upstream` (the
    one every earlier attempt that may have executed went to), after attempt `asked_about`."""

    upstream: str = ""
    asked_about: int = 0
    asked_at: datetime | None = None


class UnknownJobs:
    """What a retry of an `unknown` job can do about it, with the collaborators of one process:
    what the route the retry took declares (SPEC §3.6), never another route of its path.

    `reconciler` is read when asked for: the background reconciler starts with housekeeping,
    after the request path was built (proxy/app.py)."""

    __slots__ = ("_jobs", "_lease", "_on_resent", "_reconciler", "_store")

    def __init__(
        self,
        store: JobStore,
        reconciler: Callable[[], Reconciler | None],
        jobs: Jobs,
        *,
        lease: float,
        on_resent: Callable[[str], None],
    ) -> None:
        self._store = store
        self._reconciler = reconciler
        self._jobs = jobs  # runs the attempts of a claimed job, a resend's too
        self._lease = lease
        self._on_resent = on_resent  # SPEC §13: idemproxy_resolutions_total{way=upstream_key}

    @staticmethod
    def resends(route: Route) -> bool:
        """Whether a request on `route` may send its `unknown` job again (core/machine.py
        `Terms.resends`)."""
        return route.resolve.upstream_honours_key is not None

    def asks(self, route: Route) -> bool:
        """Whether `route` names a reconcile endpoint to ask (`Terms.asks`)."""
        return self._reconciler() is not None and route.resolve.reconcile is not None

    async def resend(self, governed: GovernedRequest, job: Job) -> Resent | None:
        """`NeedResend`: the claim of the attempt that sends `job` again, if `may_resend` allows
        it and this request wins the CAS; else None."""
        route = governed.route
        declared = route.resolve.upstream_honours_key
        if declared is None:
            return None
        full = await self._store.get_by_id(job.id)
        first = None if full is None else first_sent(full)
        group = (route.upstream, *route.fallbacks)
        if full is None or first is None or first.upstream not in group:
            return None
        now = datetime.now(UTC)
        ask = ResendAsk(governed.intent.fingerprint, _sent(governed), first.upstream, now)
        rule = may_resend(full, ask, window=declared.window)
        if rule is not Resend.ALLOWED:
            log.info("job %s: not sent again under its key (%s)", job.id, rule.value)
            return None
        # Not noted as unsent if its answer is lost: a job in flight that nobody runs is taken
        # over as unknown when its lease runs out (SPEC §3.5), never released (the first may
        # have run).
        claimed = await self._store.resend(
            full, first.number, first.upstream, window=declared.window,
            lease=self._lease, token=new_job_id(),
        )  # fmt: skip
        if claimed is None:
            return None
        asked = full.attempts[-1].number
        return Resent(claimed.job, claimed.attempt, first.upstream, asked, now)

    async def ask(self, route: Route, job: Job) -> datetime | None:
        """`NeedAsk`: a question to the reconcile endpoint of `route`, the retry's, if one is
        due; when the next one is due if the job is still `unknown` then."""
        reconciler, endpoint = self._reconciler(), Endpoint.of_route(route)
        if reconciler is None or endpoint is None:
            return None
        return await reconciler.for_retry(job, endpoint)

    async def run_claimed(
        self, governed: GovernedRequest, claimed: Claimed
    ) -> web.StreamResponse | None:
        """`Jobs.run`, or the resend of a `Resent` claim; on a route whose upstream honours the
        key, the digest of what the attempt sends is kept first (SPEC §3.6)."""
        if self.resends(governed.route):
            await self._note_sent(governed, claimed)
        if not isinstance(claimed, Resent):
            return await self._jobs.run(governed, claimed)
        attempt = AttemptRun(
            claimed.job, claimed.attempt, claimed.upstream, Mode.FINAL, resend=True
        )
        step = await self._jobs.attempts.run(governed, attempt)
        assert not isinstance(step, HandedBack), "a final attempt never hands back"
        await self._record(claimed, await self._answered(claimed), lost=step is None)
        return step

    async def _answered(self, resent: Resent) -> int | None:
        """The status the upstream answered the resend with, as its attempt keeps it: None when
        no upstream answered (a timeout, a reset, a connect failure), whatever problem the
        proxy gave its client then."""
        try:
            job = await self._store.get_by_id(resent.job.id)
        except StoreUnavailable:
            return None
        attempts = () if job is None else job.attempts
        return next((a.status for a in attempts if a.number == resent.attempt), None)

    async def _note_sent(self, governed: GovernedRequest, claimed: Claimed) -> None:
        """Best effort: without it, the job is never sent again (`may_resend` refuses)."""
        try:
            await self._store.note_sent(claimed.job, claimed.attempt, _sent(governed))
        except StoreUnavailable:
            job_id, number = claimed.job.id, claimed.attempt
            log.warning("job %s: what attempt %d sent was not noted", job_id, number)

    async def _record(self, resent: Resent, status: int | None, *, lost: bool) -> None:
        """The resend as evidence on the attempt it was about, and counted (SPEC §3.6, §13)."""
        verdict = read_resend_answer(status)
        result = "lost" if lost else ("completed" if verdict.value == "executed" else "unknown")
        self._on_resent(result)
        evidence = Evidence(
            way=Way.UPSTREAM_KEY.value,
            asked_at=resent.asked_at or datetime.now(UTC),
            answered_at=None if status is None else datetime.now(UTC),
            status=status,
            verdict=verdict.value,
            reason=f"sent again as attempt {resent.attempt}: {result}",
        )
        try:
            await self._store.record_evidence(resent.job, resent.asked_about, evidence)
        except StoreUnavailable:
            log.warning("job %s: the resend's evidence was not kept", resent.job.id)


_ASKED_AGAIN = (
    "The outcome of the earlier request with this key is unknown; the proxy will ask the backend"
    " again at next_check_at (an operator may also resolve it)."
)


def next_check_of(problem: ProblemError, next_check: datetime | None) -> ProblemError:
    """SPEC §8, §3.6: a still-unknown job says when it will next be asked about, and that it
    need not wait for an operator."""
    if next_check is not None and isinstance(problem, OutcomeUnknown):
        wait = (next_check - datetime.now(UTC)).total_seconds()
        problem.retry_after = max(math.ceil(wait), 1)
        problem.members = {"next_check_at": next_check.astimezone(UTC).isoformat()}
        if type(problem) is OutcomeUnknown:  # a subclass's detail says more (JobLost)
            problem.detail = _ASKED_AGAIN
    return problem


def _sent(governed: GovernedRequest) -> str:
    body, request = governed.body, governed.request
    memory = body.memory
    body_sha256 = body.raw_sha256 if memory is None else hashlib.sha256(memory).digest()
    return sent_digest(request.method, request.raw_path, body_sha256)
