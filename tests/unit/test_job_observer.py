"""What the job-level driver reports reaches the request's record, the metrics and the
failpoints through one observer (proxy/jobs/governed.py); spans only when tracing is on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from prometheus_client import CollectorRegistry

from idemproxy.core.types import Claimed, Job, JobState
from idemproxy.observe.metrics import Metrics, RequestOutcome
from idemproxy.proxy.failpoints import Failpoints
from idemproxy.proxy.jobs.governed import JobObserver, TracedJobObserver, job_observer
from idemproxy.proxy.jobs.jobrun import AttemptObserver, attempt_observer
from idemproxy.proxy.server.trace import Trace

JOB = Job("job-1", "owner", "key", "f" * 64, JobState.IN_FLIGHT, 1, 1)


def observer() -> tuple[JobObserver, CollectorRegistry]:
    registry = CollectorRegistry()
    return job_observer(Metrics(registry), Failpoints(None), None), registry


def test_without_tracing_the_observer_makes_no_span() -> None:
    untraced, _ = observer()
    assert type(untraced) is JobObserver
    assert not isinstance(untraced, TracedJobObserver)


def test_running_a_claimed_job_records_it_as_new() -> None:
    trace = Trace()
    observer()[0].running(trace, Claimed(JOB, 2))
    assert (trace.outcome, trace.job_id, trace.attempt) == (RequestOutcome.NEW, "job-1", 2)


def test_a_replay_after_a_hold_is_recorded_as_held() -> None:
    trace, untraced = Trace(), observer()[0]

    async def hold() -> tuple[str, Job | None]:
        return "next", JOB

    async def held() -> tuple[str, Job | None]:
        return await untraced.holding(trace, JOB.id, hold())

    assert asyncio.run(held()) == ("next", JOB)  # the hold's own result
    untraced.replayed(trace, JOB.id, 201)
    assert (trace.outcome, trace.job_id) == (RequestOutcome.HELD, "job-1")


def test_a_plain_replay_is_recorded_as_replayed() -> None:
    trace = Trace()
    observer()[0].replayed(trace, JOB.id, 201)
    assert (trace.outcome, trace.job_id) == (RequestOutcome.REPLAYED, "job-1")


def test_a_quota_refusal_is_counted_by_limit() -> None:
    untraced, registry = observer()
    untraced.over_quota("in_flight")
    refused = registry.get_sample_value("idemproxy_quota_refusals_total", {"limit": "in_flight"})
    assert refused == 1.0


def test_without_tracing_an_attempts_steps_go_through_as_they_are() -> None:
    """The attempt's driver awaits what its observer gives back: with tracing off, the very
    awaitable of each step, nothing wrapped around it and nothing made per request."""
    untraced = attempt_observer(None)
    assert type(untraced) is AttemptObserver and untraced is attempt_observer(None)

    async def step() -> bool:
        return True

    completing, settling = step(), step()
    assert untraced.completing("job-1", 1, completing) is completing
    assert untraced.settling("job-1", 1, JobState.UNKNOWN, settling) is settling
    assert asyncio.run(_both(completing, settling)) == (True, True)


async def _both(first: Awaitable[bool], second: Awaitable[bool]) -> tuple[bool, bool]:
    return await first, await second
