"""What the job-level driver (proxy/jobs/governed.py) reports, and who listens (STYLE: observation
beside the path): the request's record (proxy/server/trace.py: its outcome, job and attempt for the
metrics and the log line), the metrics, the test failpoints and, when `tracing.enabled` is set,
the spans (proxy/tracing.py). The driver tells one observer what happened; which of them listen
is chosen once per process, so the path itself tests for none of them.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from idemproxy.core.resolution import Way
from idemproxy.core.types import Claimed, ClaimResult, Job
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.failpoints import Failpoints
from idemproxy.proxy.server.trace import Trace

if TYPE_CHECKING:  # imported only when tracing is on (the optional extra `idemproxy[otel]`)
    from idemproxy.proxy.tracing import Tracing

T = TypeVar("T")


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
        """The request runs the job it claimed (its attempts follow)."""
        trace.ran(claimed.job.id, claimed.attempt)
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
