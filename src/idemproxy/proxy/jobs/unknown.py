"""A retry of an `unknown` job on a route that can resolve it (SPEC §3.6), beside the governed
loop: the loop's `AskAbout` decision comes here once per request.

* On a route whose upstream honours the key, the request is sent again under it as a new
  attempt, when core/resolution.py `may_resend` allows it: one retry wins the store's CAS, and
  the upstream's final answer completes the job (a `Resent` claim, run by `run_claimed`).
* Else, on a route with a reconcile endpoint, the backend is asked (if a question is due), and
  a job still unknown says when the next question is due (Retry-After, `next_check_at`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime

from aiohttp import web

from idemproxy.core.attempts import Mode
from idemproxy.core.resolution import (
    Resend,
    ResendAsk,
    Way,
    first_sent,
    may_resend,
    read_resend_answer,
)
from idemproxy.core.types import Claimed, Evidence, Job, JobState
from idemproxy.errors import OutcomeUnknown, ProblemError, StoreUnavailable
from idemproxy.identity.ids import new_job_id
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.jobs.attempt import AttemptRun, Failed, run_attempt
from idemproxy.proxy.jobs.jobrun import run_job
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.resending import sent_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Resent(Claimed):
    """A claim of the attempt that sends an `unknown` job's request again, on `upstream` (the
    one every earlier attempt that may have executed went to), after attempt `asked_about`."""

    upstream: str = ""
    asked_about: int = 0
    asked_at: datetime | None = None


class RetryQuestion:
    """This request's one question about an `unknown` job, and when the next one is due."""

    __slots__ = ("asked", "next_check")

    def __init__(self) -> None:
        self.asked = False
        self.next_check: datetime | None = None

    def may_ask(self, ctx: ProxyContext, job: Job) -> bool:
        # The state first: this runs on every turn of the loop, every replay's included.
        if job.state is not JobState.UNKNOWN or self.asked:
            return False
        resender, reconciler = ctx.resender, ctx.reconciler
        return (resender is not None and resender.covers(job)) or (
            reconciler is not None and reconciler.covers(job)
        )

    async def ask(self, governed: GovernedRequest, job: Job, *, ran: bool) -> Resent | None:
        """A resend this request runs, if it may; else a question to the reconcile endpoint.
        `ran`: this request ran an attempt already (it never runs a second)."""
        self.asked = True
        ctx = governed.ctx
        if not ran and not ctx.draining:
            resent = await _resend(governed, job)
            if resent is not None:
                return resent
        if ctx.reconciler is not None and ctx.reconciler.covers(job):
            self.next_check = await ctx.reconciler.for_retry(job)
        return None

    def next_check_of(self, problem: ProblemError) -> ProblemError:
        """SPEC §8, §3.6: a still-unknown job says when it will next be asked about."""
        if self.next_check is not None and isinstance(problem, OutcomeUnknown):
            wait = (self.next_check - datetime.now(UTC)).total_seconds()
            problem.retry_after = max(math.ceil(wait), 1)
            problem.members = {"next_check_at": self.next_check.astimezone(UTC).isoformat()}
        return problem


async def _resend(governed: GovernedRequest, job: Job) -> Resent | None:
    ctx = governed.ctx
    declared = None if ctx.resender is None else ctx.resender.route_of(job.path)
    if declared is None:
        return None
    full = await ctx.store.get_by_id(job.id)
    first = None if full is None else first_sent(full)
    if full is None or first is None or first.upstream not in declared.upstreams:
        return None
    ask = ResendAsk(
        governed.intent.fingerprint,
        _sent(governed),
        first.upstream,
        datetime.now(UTC),
    )
    rule = may_resend(full, ask, window=declared.window)
    if rule is not Resend.ALLOWED:
        log.info("job %s: not sent again under its key (%s)", job.id, rule.value)
        return None
    # Not noted as unsent if its answer is lost: a job in flight that nobody runs is taken over
    # as unknown when its lease runs out (SPEC §3.5), never released (the first may have run).
    claimed = await ctx.store.resend(
        full, first.number, first.upstream, window=declared.window,
        lease=ctx.settings.lease, token=new_job_id(),
    )  # fmt: skip
    if claimed is None:
        return None
    asked = full.attempts[-1].number
    return Resent(claimed.job, claimed.attempt, first.upstream, asked, datetime.now(UTC))


async def run_claimed(governed: GovernedRequest, claimed: Claimed) -> web.StreamResponse | None:
    """`run_job`, or the resend of a `Resent` claim; on a route whose upstream honours the key,
    the digest of what the attempt sends is kept first (SPEC §3.6)."""
    ctx = governed.ctx
    if ctx.resender is not None and ctx.resender.route_of(claimed.job.path) is not None:
        await _note_sent(governed, claimed)
    if not isinstance(claimed, Resent):
        return await run_job(governed, claimed)
    attempt = AttemptRun(claimed.job, claimed.attempt, claimed.upstream, Mode.FINAL, resend=True)
    step = await run_attempt(governed, attempt)
    assert not isinstance(step, Failed), "a final attempt never hands back"
    await _record(ctx, claimed, None if step is None else step.status, lost=step is None)
    return step


def _sent(governed: GovernedRequest) -> str:
    body, request = governed.body, governed.request
    body_sha256 = body.raw_sha256 or hashlib.sha256(body.memory).digest()
    return sent_digest(request.method, request.raw_path, body_sha256)


async def _note_sent(governed: GovernedRequest, claimed: Claimed) -> None:
    """Best effort: without it, the job is never sent again (`may_resend` refuses)."""
    digest = _sent(governed)
    try:
        await governed.ctx.store.note_sent(claimed.job, claimed.attempt, digest)
    except StoreUnavailable:
        log.warning("job %s: what attempt %d sent was not noted", claimed.job.id, claimed.attempt)


async def _record(ctx: ProxyContext, resent: Resent, status: int | None, *, lost: bool) -> None:
    """The resend as evidence on the attempt it was about, and counted (SPEC §3.6, §13)."""
    verdict = read_resend_answer(status)
    result = "lost" if lost else ("completed" if verdict.value == "executed" else "unknown")
    ctx.metrics.resolutions.labels(Way.UPSTREAM_KEY.value, result).inc()
    evidence = Evidence(
        way=Way.UPSTREAM_KEY.value,
        asked_at=resent.asked_at or datetime.now(UTC),
        answered_at=datetime.now(UTC),
        status=status,
        verdict=verdict.value,
        reason=f"sent again as attempt {resent.attempt}: {result}",
    )
    try:
        await ctx.store.record_evidence(resent.job, resent.asked_about, evidence)
    except StoreUnavailable:
        log.warning("job %s: the resend's evidence was not kept", resent.job.id)
