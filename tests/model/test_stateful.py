"""Model-based test of the decision core and both stores (SPEC §2, §3, §11; issue 8 item 3).

A Hypothesis state machine drives random interleavings of everything the proxy, its operators and
its sweeper do to jobs: claims by several owners on a few keys with a couple of fingerprints,
attempt results classified by `classify_response` / `classify_failure` (completions — late and
stale ones too —, releases, timeouts, fail-overs, hedged attempts), lease expiries and
take-overs, retries of released jobs, operator resolutions, expiry (`forget`, `sweep_expired`) and
deletion. `ModelStore` is the reference semantics in plain Python; every store call is made on
the model and on the real store, and their answers must agree. After every step the invariants
are checked on what the store shows:

* at most one winning completion per job, and a completed response never changes;
* `completed` is final; `unknown` leaves only by a resolution (which is recorded);
* a job id lives under one (owner, key) only, and a claim never returns another owner's job;
* `decide()` on every job read gives what SPEC §2.3 says for each fingerprint and profile, and a
  replay is always the job's first winning response;
* one execution per intent: the upstreams' ledger records every attempt that executed, or may
  have (it answered with anything but a release status — a 2xx that breaks the contract too —,
  timed out or broke after sending, or was taken over). A new attempt of a job (a fail-over, a
  retry of a released job, a hedge) starts only while no earlier attempt of it is in the ledger,
  unless an operator resolved the job since; the proxy's own rules decide (`moves_on`,
  `race_outcome`, `classify_breach`), so a rule that released or failed over after an execution
  shows here.

`IDEMPROXY_MODEL_SCALE` multiplies the number of examples (e.g. 20 for a soak run) and
`IDEMPROXY_MODEL_STEPS` sets the number of steps per example.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from idemproxy.constants import DEFAULT_RELEASE_STATUSES, DEFAULT_UNKNOWN_STATUSES
from idemproxy.core.attempt_order import race_outcome
from idemproxy.core.decision import (
    Decision,
    Forget,
    Hold,
    Policy,
    Reject,
    Replay,
    StartNextAttempt,
    TakeOver,
    decide,
)
from idemproxy.core.machine import (
    Failure,
    Outcome,
    StatusPolicy,
    classify_breach,
    classify_failure,
    classify_response,
    moves_on,
)
from idemproxy.core.types import (
    Attempt,
    AttemptState,
    Claimed,
    ClaimResult,
    Existing,
    Intent,
    Job,
    JobState,
    StoredResponse,
)
from idemproxy.errors import (
    ContractViolation,
    OutcomeUnknown,
    PayloadMismatch,
    RequestInFlight,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from idemproxy.store.base import AttemptFailure
from idemproxy.store.cache.memory import MemoryReplayCache
from idemproxy.store.layers import HOT_PATH, StoreStack
from idemproxy.store.postgres.store import Connections, PostgresStore
from idemproxy.store.sqlite.store import SqliteStore

# Longer runs: IDEMPROXY_MODEL_SCALE multiplies the examples, IDEMPROXY_MODEL_STEPS sets the
# steps per example (docs/reliability.md).
SCALE = max(float(os.environ.get("IDEMPROXY_MODEL_SCALE", "1")), 0.01)
STEPS = int(os.environ.get("IDEMPROXY_MODEL_STEPS", "0"))
# A passing run takes seconds; shrinking a failure to its minimal example may take minutes.
patient = pytest.mark.timeout(600 * max(SCALE, 1.0) * max(STEPS / 100, 1.0))

OWNERS = ("alice", "bob", "carol")
KEYS = ("k1", "k2")
FINGERPRINTS = ("fp-a", "fp-b")
UPSTREAMS = ("primary", "fallback")
METHOD, PATH = "POST", "/charges"
LONG = 3600.0  # never runs out during a test
# A ttl or lease of 0 has run out by the database clock at the next statement: expiry and
# lease loss without sleeping, and without any guess about timing.
TIMES = st.sampled_from((0.0, LONG))
STATUSES = StatusPolicy(DEFAULT_RELEASE_STATUSES, DEFAULT_UNKNOWN_STATUSES)
# Statuses an upstream answers with: stored and replayed, or released, or unknown (SPEC §3.2).
ANSWERS = (200, 201, 204, 404, 409, 500, *DEFAULT_RELEASE_STATUSES, *DEFAULT_UNKNOWN_STATUSES)
# 2xx answers whose body breaks the route's contract (SPEC §3.4): the upstream acted.
BREACHES = (200, 201, 202)
HEADERS = (
    (("Content-Type", "application/json"), ("X-Dup", "a"), ("x-dup", "b")),
    (),
    (("Content-Type", "application/octet-stream"), ("Location", "/charges/1")),
)
BODIES = (b'{"id":"ch_1"}', b"", b"\x00\xff\xfe not utf-8 \x80", None)  # None: not stored
# How the proxy records a failed attempt: settle the job, fail over to the next upstream (only
# for a release), or finish one racer of several (hedging), alone or with the last racer's settle.
HOW = st.sampled_from(("settle", "fail_over", "hedged", "hedged_then_settle"))
# Which live attempt ends, or which job an operator or a retry acts on (an index into the
# candidates), and on which reading of that job: 0 read afresh with `get`, 1 with `watch_job`,
# 2 or 3 a reading that many versions old (stale).
WHICH = st.integers(0, 15)
BACK = st.integers(0, 3)
MAX_LIVE = 6  # attempts running at once, beyond which nobody hedges
RESOLVED = (
    StoredResponse(201, (("Content-Type", "application/json"),), b'{"resolved":true}'),
    StoredResponse(200, (), b""),
)
POLICIES = (Policy(hold_in_flight=True), Policy(hold_in_flight=False))
TERMINAL = (JobState.COMPLETED, JobState.RELEASED)
# Job state changes a reader may see between two looks at the same job id (SPEC §3.1); every
# rule makes at most one change to a job before it is looked at again.
ALLOWED = {
    JobState.IN_FLIGHT: set(JobState),
    JobState.RELEASED: {JobState.RELEASED, JobState.IN_FLIGHT},
    JobState.UNKNOWN: {JobState.UNKNOWN, JobState.RELEASED, JobState.COMPLETED},
    JobState.COMPLETED: {JobState.COMPLETED},
}
ATTEMPT_STATE = {JobState.RELEASED: AttemptState.FAILED, JobState.UNKNOWN: AttemptState.UNKNOWN}
SETTLED = {Outcome.RELEASE: JobState.RELEASED, Outcome.UNKNOWN: JobState.UNKNOWN}


# --- the reference semantics ------------------------------------------------------------------


@dataclass
class ModelJob:
    id: str
    owner: str
    key: str
    fingerprint: str
    expires_now: bool  # expires_at has passed (ttl 0)
    lease_now: bool  # the lease has run out (lease 0); meaningful while in flight
    attempts: dict[int, tuple[str, AttemptState]]
    state: JobState = JobState.IN_FLIGHT
    version: int = 1
    attempt_count: int = 1
    completed_by: int | None = None
    response: StoredResponse | None = None
    resolution: str | None = None

    def snapshot(self, with_attempts: bool = False) -> Job:
        attempts = tuple(
            Attempt(number, upstream, state)
            for number, (upstream, state) in sorted(self.attempts.items())
        )
        return Job(
            id=self.id,
            owner=self.owner,
            key=self.key,
            fingerprint=self.fingerprint,
            state=self.state,
            version=self.version,
            attempt_count=self.attempt_count,
            method=METHOD,
            path=PATH,
            completed_by=self.completed_by,
            response=self.response,
            expired=self.expires_now,
            lease_expired=self.state is JobState.IN_FLIGHT and self.lease_now,
            resolution=self.resolution,
            attempts=attempts if with_attempts else (),
        )

    def start(self, number: int, upstream: str, lease: float) -> None:
        self.attempts[number] = (upstream, AttemptState.STARTED)
        self.lease_now = lease == 0

    def finish(
        self, number: int, state: AttemptState, *, also: tuple[AttemptState, ...] = ()
    ) -> None:
        upstream, current = self.attempts[number]
        if current in (AttemptState.STARTED, *also):
            self.attempts[number] = (upstream, state)


@dataclass
class ModelStore:
    """What `Store` promises, as plain Python over dicts (one process, no clock)."""

    jobs: dict[tuple[str, str], ModelJob] = field(default_factory=dict)

    def current(self, job: Job) -> ModelJob | None:
        found = self.jobs.get((job.owner, job.key))
        return found if found is not None and found.id == job.id else None

    def at(self, job: Job, *states: JobState) -> ModelJob | None:
        """The job if `job` is a snapshot of its current version in one of `states`."""
        found = self.current(job)
        ok = found is not None and found.version == job.version and found.state in states
        return found if ok else None

    def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        slot = (intent.owner, intent.key)
        existing = self.jobs.get(slot)
        if existing is not None:
            return Existing(existing.snapshot())
        job = ModelJob(
            job_id, intent.owner, intent.key, intent.fingerprint, ttl == 0, lease == 0, {}
        )
        job.start(1, upstream, lease)
        self.jobs[slot] = job
        return Claimed(job.snapshot(), 1)

    def get(self, owner: str, key: str) -> Job | None:
        job = self.jobs.get((owner, key))
        return None if job is None else job.snapshot()

    watch_job = get

    def get_by_id(self, job_id: str) -> Job | None:
        found = [job for job in self.jobs.values() if job.id == job_id]
        return found[0].snapshot(with_attempts=True) if found else None

    def complete(self, job: Job, attempt: int, response: StoredResponse, *, ttl: float) -> bool:
        found = self.current(job)
        if found is None:
            return False
        if self.at(job, JobState.IN_FLIGHT) is None or found.completed_by is not None:
            found.finish(attempt, AttemptState.DISCARDED, also=(AttemptState.UNKNOWN,))
            return False
        found.state, found.version = JobState.COMPLETED, found.version + 1
        found.completed_by, found.response, found.expires_now = attempt, response, ttl == 0
        found.finish(attempt, AttemptState.SUCCEEDED)
        return True

    def settle(self, job: Job, attempt: int, state: JobState, **_: Any) -> bool:
        found = self.current(job)
        if found is None:
            return False
        won = self.at(job, JobState.IN_FLIGHT) is not None
        if won:
            found.state, found.version = state, found.version + 1
        found.finish(attempt, ATTEMPT_STATE[state])  # recorded whether or not the CAS won
        return won

    def finish_attempt(self, job: Job, attempt: int, state: JobState, **_: Any) -> None:
        found = self.current(job)
        if found is not None:
            found.finish(attempt, ATTEMPT_STATE[state])

    def start_next_attempt(
        self, job: Job, upstream: str, *, lease: float, **_: Any
    ) -> Claimed | None:
        found = self.at(job, JobState.RELEASED)
        if found is None:
            return None
        found.state, found.version = JobState.IN_FLIGHT, found.version + 1
        found.attempt_count += 1
        found.start(found.attempt_count, upstream, lease)
        return Claimed(found.snapshot(), found.attempt_count)

    def fail_over(
        self, job: Job, attempt: int, upstream: str, *, lease: float, **_: Any
    ) -> Claimed | None:
        found = self.at(job, JobState.IN_FLIGHT)
        if found is None:
            return None
        found.version += 1
        found.finish(attempt, AttemptState.FAILED)
        found.attempt_count += 1
        found.start(found.attempt_count, upstream, lease)
        return Claimed(found.snapshot(), found.attempt_count)

    def add_attempt(self, job: Job, upstream: str, *, lease: float) -> int | None:
        found = self.at(job, JobState.IN_FLIGHT)
        if found is None:
            return None
        found.attempt_count += 1  # the version stays: every attempt races for one CAS
        found.start(found.attempt_count, upstream, lease)
        return found.attempt_count

    def renew_lease(self, job: Job, *, lease: float) -> bool:
        found = self.at(job, JobState.IN_FLIGHT)
        if found is not None:
            found.lease_now = lease == 0
        return found is not None

    def take_over(self, job: Job) -> bool:
        found = self.at(job, JobState.IN_FLIGHT)
        if found is None or not found.lease_now:
            return False
        found.state, found.version = JobState.UNKNOWN, found.version + 1
        for number in found.attempts:
            found.finish(number, AttemptState.UNKNOWN)
        return True

    def resolve(
        self,
        job: Job,
        state: JobState,
        *,
        response: StoredResponse | None = None,
        ttl: float = 0.0,
        resolution: str = "operator",
    ) -> bool:
        found = self.at(job, JobState.UNKNOWN)
        if found is None:
            return False
        found.state, found.version, found.resolution = state, found.version + 1, resolution
        if state is JobState.COMPLETED:
            found.completed_by, found.response, found.expires_now = 0, response, ttl == 0
        return True

    def forget(self, job: Job) -> bool:
        found = self.at(job, *TERMINAL)
        if found is None or not found.expires_now:
            return False
        del self.jobs[(found.owner, found.key)]
        return True

    def delete(self, job: Job, *, force: bool = False) -> bool:
        found = self.at(job, *JobState)  # a CAS on the version read
        if found is None:
            return False
        if found.state is JobState.IN_FLIGHT and not found.lease_now and not force:
            return False  # its attempt is running: only a forced delete
        del self.jobs[(found.owner, found.key)]
        return True

    @staticmethod
    def expired(job: ModelJob) -> bool:
        return job.expires_now and job.state in TERMINAL

    def sweepable(self) -> list[ModelJob]:
        return [job for job in self.jobs.values() if self.expired(job)]

    def list_jobs(self, *, state: JobState | None = None, limit: int = 100) -> list[Job]:
        return [job.snapshot() for job in self.jobs.values() if state in (None, job.state)][:limit]

    def stale_unknown(self, older_than: float, limit: int) -> list[Job]:
        assert older_than == 0, "the model has no clock"
        return self.list_jobs(state=JobState.UNKNOWN, limit=limit)

    def count_unknown(self) -> int:
        return len(self.list_jobs(state=JobState.UNKNOWN))


def expected_decision(
    job: ModelJob, winner: StoredResponse | None, fingerprint: str, policy: Policy, waited: bool
) -> Decision:
    """SPEC §2.3 and §3.1, case by case, for a request with `fingerprint`."""
    if job.expires_now and job.state in TERMINAL:
        return Forget(job.version)  # expired: gone, whatever the sweeper has not deleted yet
    if fingerprint != job.fingerprint:
        return Reject(PayloadMismatch)
    if job.state is JobState.COMPLETED:
        assert winner is not None
        return Replay(winner)  # the first winning response, never another
    if job.state is JobState.RELEASED:
        return StartNextAttempt(job.version)
    if job.state is JobState.UNKNOWN:
        return Reject(OutcomeUnknown)
    if job.lease_now:
        return TakeOver(job.version)
    return Hold() if policy.hold_in_flight and not waited else Reject(RequestInFlight)


# --- the state machine ------------------------------------------------------------------------


@dataclass(frozen=True)
class Running:
    """An attempt some proxy is running: the job snapshot it holds and its attempt number."""

    job: Job
    number: int
    upstream: str

    def __repr__(self) -> str:
        return f"Running(job={self.job.id[-4:]}, v{self.job.version}, attempt={self.number})"


def same_job(actual: Job | None, expected: Job | None, *, flags: bool = True) -> bool:
    if actual is None or expected is None:
        return actual is expected
    fields = [
        *("id", "owner", "key", "fingerprint", "method", "path", "state", "version"),
        *("attempt_count", "completed_by", "response", "resolution"),
    ]
    if flags:  # fresh snapshots from a write may compute them differently (PostgreSQL: false)
        fields += ["expired", "lease_expired"]
    return all(getattr(actual, name) == getattr(expected, name) for name in fields)


def agree(actual: object, expected: object) -> bool:
    if isinstance(expected, list):
        key = operator.attrgetter("id")
        return (
            isinstance(actual, list)
            and len(actual) == len(expected)
            and all(map(agree, sorted(actual, key=key), sorted(expected, key=key)))
        )
    if isinstance(expected, Claimed):
        return (
            isinstance(actual, Claimed)
            and actual.attempt == expected.attempt
            and same_job(actual.job, expected.job, flags=False)
        )
    if isinstance(expected, Existing):
        return isinstance(actual, Existing) and same_job(actual.job, expected.job)
    if isinstance(expected, Job):
        return isinstance(actual, Job) and same_job(actual, expected)
    return type(actual) is type(expected) and actual == expected


class IdempotencyMachine(RuleBasedStateMachine):
    """Pure variant: the model alone stands in for the store; `decide()` is checked on it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ModelStore()
        self.store: StoreStack | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ids = itertools.count(1)
        self.winners: dict[str, StoredResponse] = {}  # job id -> its one winning response
        self.home: dict[str, tuple[str, str]] = {}  # job id -> (owner, key) it lives under
        self.seen: dict[str, JobState] = {}  # job id -> state at its last reading
        self.gone: set[str] = set()  # deleted or expired job ids: never seen again
        self.touched: set[str] = set()  # job ids whose attempts changed in this step
        self.sent: list[Intent] = []  # every request so far, for clients that retry
        self.live: list[Running] = []  # attempts running somewhere, until they end
        self.unknown_ids: set[str] = set()  # unknown jobs at the last look at the operators' lists
        # Every version of the jobs under each (owner, key) seen so far, oldest first.
        self.history: dict[tuple[str, str], list[Job]] = {}
        # The upstreams' ledger: job id -> attempts that executed or may have (see the module
        # docstring); job id -> the attempt count when an operator last resolved it (the
        # attempts up to it are the operator's call, not the proxy's).
        self.executed: dict[str, set[int]] = {}
        self.resolved_at: dict[str, int] = {}
        # (job id, version) -> outcomes of the racers of that version that failed so far.
        self.raced: dict[tuple[str, int], list[Outcome]] = {}

    # -- calling the model and the store -------------------------------------------------------

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        expected = getattr(self.model, name)(*args, **kwargs)
        if self.store is None:
            return expected
        assert self.loop is not None
        # The request path's calls go through the stack's layers, the rest to the record.
        port = self.store.jobs if name in HOT_PATH else self.store.record
        actual = self.loop.run_until_complete(getattr(port, name)(*args, **kwargs))
        assert agree(actual, expected), f"{name}: the store said {actual!r}, the model {expected!r}"
        return actual

    def claim(self, intent: Intent, ttl: float, lease: float) -> ClaimResult:
        job_id = str(uuid.UUID(int=next(self.ids)))
        result: ClaimResult = self.call("claim", intent, job_id, UPSTREAMS[0], ttl=ttl, lease=lease)
        job = result.job
        # A claim under one owner never returns another owner's job (SPEC §5).
        assert (job.owner, job.key) == (intent.owner, intent.key), job
        assert (job.id == job_id) is isinstance(result, Claimed), result
        self.observe(job, decisions=isinstance(result, Existing))
        return result

    def observe(self, job: Job, *, decisions: bool = True) -> None:
        """Check one reading of a job against everything seen before it."""
        assert job.id not in self.gone, f"job {job.id} came back after it was deleted"
        home = self.home.setdefault(job.id, (job.owner, job.key))
        assert home == (job.owner, job.key), f"job {job.id} seen under {home} and {job.owner}"
        before = self.seen.get(job.id)
        if before is not None:
            assert job.state in ALLOWED[before], f"job {job.id}: {before} -> {job.state}"
            if before is JobState.UNKNOWN and job.state is not JobState.UNKNOWN:
                # SPEC §3.1: unknown is left only by an explicit resolution.
                assert job.resolution is not None, job
                assert job.state is not JobState.COMPLETED or job.completed_by == 0, job
        self.seen[job.id] = job.state
        history = self.history.setdefault((job.owner, job.key), [])
        if not history or (history[-1].id, history[-1].version) != (job.id, job.version):
            history.append(job)
        if job.state is JobState.COMPLETED:
            assert job.id in self.winners, f"job {job.id} completed without a winning call"
            assert job.response == self.winners[job.id], "a completed response changed"
        else:
            assert job.id not in self.winners, f"job {job.id} left completed"
        if decisions:
            self.check_decisions(job)

    def check_decisions(self, job: Job) -> None:
        model = self.model.jobs.get((job.owner, job.key))
        assert model is not None and model.id == job.id, "decisions need a current reading"
        winner = self.winners.get(job.id)
        for fingerprint, policy, waited in itertools.product(FINGERPRINTS, POLICIES, (False, True)):
            got = decide(job, fingerprint, policy, wait_expired=waited)
            want = expected_decision(model, winner, fingerprint, policy, waited)
            assert got == want, f"decide({fingerprint}, {policy}, {waited}): {got} != {want}"

    def won(self, job: Job, response: StoredResponse) -> None:
        assert job.id not in self.winners, f"a second completion of job {job.id} won the CAS"
        self.winners[job.id] = response

    def removed(self, job_id: str) -> None:
        self.gone.add(job_id)
        self.touched.discard(job_id)

    # -- what clients, proxies, operators and the sweeper do -----------------------------------

    @rule(
        owner=st.sampled_from(OWNERS),
        key=st.sampled_from(KEYS),
        fingerprint=st.sampled_from(FINGERPRINTS),
        ttl=TIMES,
        lease=TIMES,
        policy=st.sampled_from(POLICIES),
        follow=st.booleans(),
    )
    def request(
        self,
        owner: str,
        key: str,
        fingerprint: str,
        ttl: float,
        lease: float,
        policy: Policy,
        follow: bool,
    ) -> None:
        """A request with a key: claim, then (if `follow`) act on `decide()` as the proxy does."""
        intent = Intent(owner, key, fingerprint, METHOD, PATH)
        self.sent.append(intent)
        self.send(intent, ttl, lease, policy, follow=follow)

    @precondition(lambda self: self.sent)
    @rule(
        which=st.integers(0, 15),
        same_payload=st.booleans(),
        ttl=TIMES,
        lease=TIMES,
        policy=st.sampled_from(POLICIES),
    )
    def duplicate(
        self, which: int, same_payload: bool, ttl: float, lease: float, policy: Policy
    ) -> None:
        """A client retries one of the earlier requests (or reuses its key for another payload)."""
        sent = self.sent[-1 - which % len(self.sent)]
        if not same_payload:
            other = [fp for fp in FINGERPRINTS if fp != sent.fingerprint]
            sent = Intent(sent.owner, sent.key, other[0], METHOD, PATH)
        self.send(sent, ttl, lease, policy, follow=True)

    def send(
        self, intent: Intent, ttl: float, lease: float, policy: Policy, *, follow: bool
    ) -> None:
        result = self.claim(intent, ttl, lease)
        for _ in range(3):
            if isinstance(result, Claimed):
                self.started(result, UPSTREAMS[0])
                return
            job = result.job
            decision = decide(job, intent.fingerprint, policy)
            if not follow or isinstance(decision, Hold | Reject):
                break
            if isinstance(decision, Replay):
                assert intent.fingerprint == job.fingerprint
                assert decision.response == self.winners[job.id]
                break
            if isinstance(decision, StartNextAttempt):
                claimed = self.call("start_next_attempt", job, UPSTREAMS[0], lease=lease)
                if claimed is None:
                    break
                result = claimed
            elif isinstance(decision, TakeOver):
                self.taken_over(job, self.call("take_over", job))
                current = self.read(intent.owner, intent.key)
                if current is None:
                    break
                result = Existing(current)
            elif isinstance(decision, Forget):
                if self.call("forget", job):
                    self.removed(job.id)
                result = self.claim(intent, ttl, lease)

    @precondition(lambda self: self.live)
    @rule(
        which=WHICH,
        late=st.booleans(),
        status=st.sampled_from(ANSWERS),
        headers=st.sampled_from(HEADERS),
        body=st.sampled_from(BODIES),
        ttl=TIMES,
        lease=TIMES,
        how=HOW,
    )
    def upstream_answers(
        self,
        which: int,
        late: bool,
        status: int,
        headers: tuple[tuple[str, str], ...],
        body: bytes | None,
        ttl: float,
        lease: float,
        how: str,
    ) -> None:
        """The upstream answered: classify the status (SPEC §3.2) and record it as the proxy does.
        With `late`, preferably an attempt whose job moved on since it started (another attempt
        won or failed over, a take-over, a resolution): a late result."""
        attempt = self.ends(which, late)
        self.ran(attempt, status not in DEFAULT_RELEASE_STATUSES)
        outcome = classify_response(status, STATUSES)
        assert (outcome is Outcome.RELEASE) is (status in DEFAULT_RELEASE_STATUSES)
        assert (outcome is Outcome.UNKNOWN) is (status in DEFAULT_UNKNOWN_STATUSES)
        if outcome is not Outcome.COMPLETE:
            self.attempt_failed(attempt, outcome, status, None, lease, how)
            return
        response = StoredResponse(status, headers, body)
        self.touched.add(attempt.job.id)
        if self.call("complete", attempt.job, attempt.number, response, ttl=ttl):
            self.won(attempt.job, response)

    @precondition(lambda self: any(self.overtaken(attempt.job) for attempt in self.live))
    @rule(which=WHICH, status=st.sampled_from(ANSWERS), how=HOW)
    def late_result(self, which: int, status: int, how: str) -> None:
        """The upstream answers an attempt whose job is in flight again under a newer version
        (a sibling failed over; a retry after a release, or after a take-over and a resolution):
        the most dangerous late result. Its CAS must lose: a success is discarded, never stored
        (SPEC §2.4, §3.2), and a failure leaves the job to the attempt that runs it now."""
        overtaken = [i for i, attempt in enumerate(self.live) if self.overtaken(attempt.job)]
        attempt = self.live.pop(overtaken[which % len(overtaken)])
        self.ran(attempt, status not in DEFAULT_RELEASE_STATUSES)
        outcome = classify_response(status, STATUSES)
        if outcome is not Outcome.COMPLETE:
            self.attempt_failed(attempt, outcome, status, None, LONG, how)
            return
        response = StoredResponse(status, HEADERS[which % len(HEADERS)], BODIES[which % 4])
        self.touched.add(attempt.job.id)
        if self.call("complete", attempt.job, attempt.number, response, ttl=LONG):
            self.won(attempt.job, response)

    @precondition(lambda self: self.live)
    @rule(which=WHICH, late=st.booleans(), failure=st.sampled_from(Failure), lease=TIMES, how=HOW)
    def transport_fails(
        self, which: int, late: bool, failure: Failure, lease: float, how: str
    ) -> None:
        """Connect failure, timeout or broken response (SPEC §3.2)."""
        attempt = self.ends(which, late)
        self.ran(attempt, failure is not Failure.CONNECT)  # SPEC §3.2: once a byte was sent
        outcome, problem = classify_failure(failure)
        assert outcome is (Outcome.RELEASE if failure is Failure.CONNECT else Outcome.UNKNOWN)
        assert problem is (UpstreamTimeout if failure is Failure.TIMEOUT else UpstreamUnavailable)
        self.attempt_failed(attempt, outcome, None, failure.value, lease, how)

    @precondition(lambda self: self.live)
    @rule(
        which=WHICH,
        late=st.booleans(),
        status=st.sampled_from(BREACHES),
        lease=TIMES,
        how=HOW,
    )
    def upstream_breaks_contract(
        self, which: int, late: bool, status: int, lease: float, how: str
    ) -> None:
        """A 2xx whose body breaks the route's contract, or is too large to check (SPEC §3.4):
        the upstream executed the request, and the proxy must neither store the answer nor run
        the request again."""
        attempt = self.ends(which, late)
        self.ran(attempt, True)
        outcome, problem = classify_breach()
        assert problem is ContractViolation
        self.attempt_failed(attempt, outcome, status, "contract: /ok: required", lease, how)

    def attempt_failed(
        self,
        attempt: Running,
        outcome: Outcome,
        status: int | None,
        error: str | None,
        lease: float,
        how: str,
    ) -> None:
        """Record a failed attempt as the proxy does (proxy/jobs/jobrun.py): while other
        attempts of the same job race, only its own end; a fail-over only after an outcome that
        `moves_on`; the job's settlement, when it is the last, by `race_outcome`."""
        job, number = attempt.job, attempt.number
        self.touched.add(job.id)
        race = (job.id, job.version)
        racing = any((r.job.id, r.job.version) == race for r in self.live)
        if racing or how == "hedged":  # one racer of several: the job is left to the others
            self.raced.setdefault(race, []).append(outcome)
            self.call("finish_attempt", job, number, SETTLED[outcome], status=status, error=error)
            return
        # SPEC §3.4: unknown never fails over; in a race the fail-over is a hedge (`hedge`).
        if how == "fail_over" and moves_on(outcome) and race not in self.raced:
            following = self.call(
                "fail_over",
                job,
                number,
                UPSTREAMS[1],
                failure=AttemptFailure(status, error),
                lease=lease,
            )
            if following is not None:
                self.started(following, UPSTREAMS[1])
            return
        if how == "hedged_then_settle":  # the last racer: its own end, then the job's
            self.call("finish_attempt", job, number, SETTLED[outcome], status=status, error=error)
        # The last racer failed too (SPEC §3.4), or the only attempt: settle the job.
        settled = race_outcome([*self.raced.pop(race, []), outcome])
        self.call("settle", job, number, SETTLED[settled], status=status, error=error)

    @precondition(lambda self: 0 < len(self.live) < MAX_LIVE)
    @rule(which=WHICH, late=st.booleans(), lease=TIMES)
    def hedge(self, which: int, late: bool, lease: float) -> None:
        """SPEC §3.4: one more attempt under the same job and version (none once the job moved
        on: the hedge timer of a stale attempt fires too late)."""
        attempt = self.live[self.choose(which, late)]
        if race_outcome(self.raced.get((attempt.job.id, attempt.job.version), [])) is not (
            Outcome.RELEASE
        ):
            # proxy/jobs/jobrun.py: no upstream is brought in once a racer may have executed
            return
        number = self.call("add_attempt", attempt.job, UPSTREAMS[1], lease=lease)
        self.touched.add(attempt.job.id)
        if number is not None:
            self.check_ledger(attempt.job.id, number)
            self.live.append(Running(attempt.job, number, UPSTREAMS[1]))

    @precondition(lambda self: self.live)
    @rule(which=WHICH, late=st.booleans(), lease=TIMES)
    def renew(self, which: int, late: bool, lease: float) -> None:
        """SPEC §3.5; a lease of 0 stands for a proxy that stopped renewing (it died)."""
        attempt = self.live[self.choose(which, late)]
        self.call("renew_lease", attempt.job, lease=lease)

    def started(self, claimed: Claimed, upstream: str) -> None:
        self.observe(claimed.job, decisions=False)  # a fresh write's flags may lag (PostgreSQL)
        self.check_ledger(claimed.job.id, claimed.attempt)
        self.touched.add(claimed.job.id)
        self.live.append(Running(claimed.job, claimed.attempt, upstream))

    def ran(self, attempt: Running, executed: bool) -> None:
        """The upstream's ledger: `attempt` executed the request, or may have."""
        if executed:
            self.executed.setdefault(attempt.job.id, set()).add(attempt.number)

    def check_ledger(self, job_id: str, number: int) -> None:
        """One execution per intent: attempt `number` starts only while no earlier attempt of
        the job executed, or may have, since an operator last resolved it."""
        since = self.resolved_at.get(job_id, 0)
        executed = sorted(n for n in self.executed.get(job_id, ()) if since < n < number)
        assert not executed, f"job {job_id}: attempt {number} started after {executed} executed"

    def choose(self, which: int, late: bool) -> int:
        """Index of a live attempt; with `late`, one whose job has moved on, if there is one."""
        indices: Sequence[int] = range(len(self.live))
        if late:
            stale = [i for i in indices if self.moved_on(self.live[i].job)]
            indices = stale or indices
        return indices[which % len(indices)]

    def overtaken(self, job: Job) -> bool:
        """The job is in flight again, under a newer version than `job`."""
        current = self.model.current(job)
        return (
            current is not None
            and current.version != job.version
            and current.state is JobState.IN_FLIGHT
        )

    def moved_on(self, job: Job) -> bool:
        current = self.model.jobs.get((job.owner, job.key))
        return current is None or (current.id, current.version) != (job.id, job.version)

    def ends(self, which: int, late: bool) -> Running:
        """The attempt whose upstream call ends now: no longer live."""
        return self.live.pop(self.choose(which, late))

    def read(self, owner: str, key: str, *, watch: bool = False) -> Job | None:
        job: Job | None = self.call("watch_job" if watch else "get", owner, key)
        if job is not None:
            self.observe(job)
        return job

    def reading(
        self, which: int, back: int, aimed: bool, wanted: Callable[[ModelJob], bool]
    ) -> Job | None:
        """A job as a proxy or an operator holds it: if `aimed`, preferably one that is `wanted`
        (in the state the actor expects: released for a retry, ...), else any; read afresh
        (`back` 0 with `get`, 1 with `watch_job`) or as it was `back` versions ago (stale)."""
        slots = [slot for slot, job in self.model.jobs.items() if aimed and wanted(job)]
        owner, key = (slots or list(self.model.jobs))[which % len(slots or self.model.jobs)]
        if back <= 1:
            return self.read(owner, key, watch=back == 1)
        history = self.history.get((owner, key), [])
        return history[max(-back, -len(history))] if history else None

    @precondition(lambda self: self.model.jobs)
    @rule(which=WHICH, back=BACK, aimed=st.booleans(), lease=TIMES)
    def retry(self, which: int, back: int, aimed: bool, lease: float) -> None:
        """SPEC §2.3: a retry of a released job; of all retries exactly one wins the CAS."""
        job = self.reading(which, back, aimed, lambda job: job.state is JobState.RELEASED)
        if job is None:
            return
        claimed = self.call("start_next_attempt", job, UPSTREAMS[0], lease=lease)
        if claimed is not None:
            self.started(claimed, UPSTREAMS[0])

    @precondition(lambda self: self.model.jobs)
    @rule(which=WHICH, back=BACK, aimed=st.booleans())
    def take_over(self, which: int, back: int, aimed: bool) -> None:
        """SPEC §3.5: wins only on the current version with its lease run out."""
        job = self.reading(
            which, back, aimed, lambda job: job.state is JobState.IN_FLIGHT and job.lease_now
        )
        if job is not None:
            self.taken_over(job, self.call("take_over", job))

    def taken_over(self, job: Job, won: bool) -> None:
        """SPEC §3.5: the dead proxy may have sent every attempt it had started."""
        self.touched.add(job.id)
        current = self.model.current(job)
        if won and current is not None:
            for number, (_, state) in current.attempts.items():
                if state is AttemptState.UNKNOWN:
                    self.executed.setdefault(job.id, set()).add(number)

    @precondition(lambda self: self.model.jobs)
    @rule(
        which=WHICH,
        back=BACK,
        aimed=st.booleans(),
        completed=st.booleans(),
        response=st.sampled_from(RESOLVED),
        ttl=TIMES,
        resolution=st.sampled_from(("operator", "unknown_ttl")),
    )
    def resolve(
        self,
        which: int,
        back: int,
        aimed: bool,
        completed: bool,
        response: StoredResponse,
        ttl: float,
        resolution: str,
    ) -> None:
        """SPEC §3.3: an operator settles an unknown job; a CAS on its version."""
        job = self.reading(which, back, aimed, lambda job: job.state is JobState.UNKNOWN)
        if job is None:
            return
        if completed:
            if self.call(
                "resolve",
                job,
                JobState.COMPLETED,
                response=response,
                ttl=ttl,
                resolution=resolution,
            ):
                self.won(job, response)
        elif self.call("resolve", job, JobState.RELEASED, resolution=resolution):
            # SPEC §3.3: the operator says what ran; a retry may execute again.
            current = self.model.current(job)
            assert current is not None
            self.resolved_at[job.id] = current.attempt_count

    @precondition(lambda self: self.model.jobs)
    @rule(
        which=WHICH,
        back=BACK,
        aimed=st.booleans(),
        how=st.sampled_from(("forget", "sweep one", "sweep all", "delete", "force delete")),
    )
    def remove(self, which: int, back: int, aimed: bool, how: str) -> None:
        """A job goes away (SPEC §11): a request forgets an expired terminal job by CAS so that
        its key can be claimed anew, the sweeper deletes a batch of expired terminal jobs (never
        one in flight or unknown), or an operator deletes the job by id."""
        if how.startswith("sweep"):
            self.sweep(1 if how == "sweep one" else 100)
            return
        job = self.reading(
            which, back, aimed, lambda job: how.endswith("delete") or self.model.expired(job)
        )
        if job is None:
            return
        removed = (
            self.call("delete", job, force=how == "force delete")
            if how.endswith("delete")
            else self.call(how, job)
        )
        if removed:
            self.removed(job.id)

    def sweep(self, batch: int) -> None:
        candidates = self.model.sweepable()
        if self.store is None:
            deleted = candidates[:batch]
        else:
            assert self.loop is not None
            count = self.loop.run_until_complete(self.store.record.sweep_expired(batch))
            assert count == min(batch, len(candidates)), (count, candidates)
            # Which of them went first is the store's choice (oldest expiry): ask it.
            deleted = [
                job
                for job in candidates
                if self.loop.run_until_complete(self.store.jobs.get(job.owner, job.key)) is None
            ]
            assert len(deleted) == count, (count, deleted)
        for job in deleted:
            del self.model.jobs[(job.owner, job.key)]
            self.removed(job.id)

    # -- after every step -----------------------------------------------------------------------

    @invariant()
    def store_agrees_with_model(self) -> None:
        if self.store is None:
            jobs = self.model.list_jobs(limit=1000)
        else:
            assert self.loop is not None
            jobs = self.loop.run_until_complete(self.store.record.list_jobs(limit=1000))
            by_slot = {(job.owner, job.key): job for job in jobs}
            assert len(by_slot) == len(jobs), "two jobs under one (owner, key)"
            assert by_slot.keys() == self.model.jobs.keys(), (by_slot.keys(), self.model.jobs)
            for slot, job in by_slot.items():
                expected = self.model.jobs[slot].snapshot()
                assert same_job(job, expected), f"store {job!r}\nmodel {expected!r}"
        for job in jobs:
            self.observe(job)
        unknown_ids = {job.id for job in self.model.jobs.values() if job.state is JobState.UNKNOWN}
        if unknown_ids != self.unknown_ids:  # SPEC §3.3: what operators see of unknown jobs
            self.unknown_ids = unknown_ids
            unknown = self.call("list_jobs", state=JobState.UNKNOWN, limit=1000)
            stale = self.call("stale_unknown", 0.0, 1000)
            assert self.call("count_unknown") == len(unknown) == len(stale)
            assert {job.id for job in unknown} == {job.id for job in stale}
        if self.store is not None:
            live = {job.id for job in self.model.jobs.values()}
            for job_id in sorted(self.touched & live):  # SPEC §3.2: every attempt's outcome
                read = self.call("get_by_id", job_id)
                assert read is not None
                want = [(a.number, a.upstream, a.state) for a in self.model_attempts(job_id)]
                got = [(a.number, a.upstream, a.state) for a in read.attempts]
                assert got == want, f"attempts of {job_id}: store {got}, model {want}"
        self.touched.clear()

    def model_attempts(self, job_id: str) -> tuple[Attempt, ...]:
        job = self.model.get_by_id(job_id)
        assert job is not None
        return job.attempts


class StoreMachine(IdempotencyMachine):
    """The same machine, every call also made on a real store (fresh for every example)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        try:
            self.store = self.loop.run_until_complete(self.open_store())
        except BaseException:
            self.loop.close()
            raise

    async def open_store(self) -> StoreStack:
        raise NotImplementedError

    def teardown(self) -> None:
        assert self.loop is not None
        try:
            if self.store is not None:
                self.loop.run_until_complete(self.store.close())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            self.cleanup()

    def cleanup(self) -> None:
        pass


_RAM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class SqliteMachine(StoreMachine):
    def __init__(self) -> None:
        # Not the test's tmp_path: each example gets a new file, and on tmpfs the store's
        # `synchronous = FULL` commits cost no fsync, so many more steps fit in the time budget.
        self.folder = Path(tempfile.mkdtemp(prefix="idemproxy-model-", dir=_RAM_DIR))
        super().__init__()

    async def open_store(self) -> StoreStack:
        store = SqliteStore(str(self.folder / "idemproxy.db"))
        await store.open()
        await store.migrate()
        return StoreStack.of(store)

    def cleanup(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class PostgresMachine(StoreMachine):
    dsn: ClassVar[str]

    async def open_store(self) -> StoreStack:
        await self.empty_database()
        store = PostgresStore(self.dsn, connections=Connections(1, 2), listen=False)
        await store.open()
        return StoreStack.of(store)

    async def empty_database(self) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:  # one database per test, emptied for every example
            await conn.execute("TRUNCATE idemproxy.jobs CASCADE")
        finally:
            await conn.close()


class CachedPostgresMachine(PostgresMachine):
    """PostgreSQL behind the in-process replay cache, as `idemproxy serve` runs it: every
    duplicate of a completed job after the first is answered from memory, and deletions,
    expiry and sweeps must still be seen exactly as without it."""

    hits: ClassVar[list[int]]  # per example: claims the cache answered

    async def open_store(self) -> StoreStack:
        await self.empty_database()
        inner = PostgresStore(self.dsn, connections=Connections(1, 2))
        store = MemoryReplayCache(inner, max_bytes=1 << 20, max_body=1 << 16, ttl=60.0)
        stack = StoreStack.of(store)
        await stack.open()
        async with asyncio.timeout(10):  # the cache serves only once the change feed is live
            while not store.watch.live:  # noqa: ASYNC110 - a flag set by the feed task
                await asyncio.sleep(0.01)
        return stack

    def teardown(self) -> None:
        cache = None if self.store is None else self.store.layer(MemoryReplayCache)
        if cache is not None:
            self.hits.append(cache.hits)
        super().teardown()


def model_settings(examples: int, steps: int) -> settings:
    return settings(
        max_examples=max(1, round(examples * SCALE)),
        stateful_step_count=STEPS or steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


@patient
def test_decisions_follow_the_model() -> None:
    """The pure model alone: fast, so many more examples."""
    run_state_machine_as_test(IdempotencyMachine, settings=model_settings(300, 100))


@patient
def test_sqlite_store_follows_the_model() -> None:
    run_state_machine_as_test(SqliteMachine, settings=model_settings(80, 100))


@patient
@pytest.mark.postgres
def test_postgres_store_follows_the_model(pg_dsn: str) -> None:
    class Machine(PostgresMachine):
        dsn = pg_dsn

    run_state_machine_as_test(Machine, settings=model_settings(50, 100))


@patient
@pytest.mark.postgres
def test_postgres_store_behind_the_replay_cache_follows_the_model(pg_dsn: str) -> None:
    class Machine(CachedPostgresMachine):
        dsn = pg_dsn
        hits: ClassVar[list[int]] = []

    run_state_machine_as_test(Machine, settings=model_settings(30, 100))
    assert sum(Machine.hits) > 0, "the examples never replayed from the cache"
