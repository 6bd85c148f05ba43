"""The storage interface every backend implements, checked by one shared test suite (SPEC §11).

Every method that changes a job is a compare-and-swap on the job's `version` (and names its
`owner`, so that every hot-path statement can be routed to one shard): it returns whether it
won, and a loser changes nothing. Driver errors never leave a store: each implementation
translates them into `StoreUnavailable` at one boundary.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import datetime
from types import TracebackType
from typing import Any, NamedTuple

from idemproxy.core.quota import QuotaLimits
from idemproxy.core.types import (
    Claimed,
    ClaimResult,
    Evidence,
    Intent,
    Job,
    JobState,
    KeptResponse,
    SealedResponse,
    StoredResponse,
)
from idemproxy.errors import ResponseUnreadable, StoreUnavailable
from idemproxy.store.batching import GroupCommit
from idemproxy.store.watch import JobWatch


class AttemptFailure(NamedTuple):
    """What a failed attempt is recorded with: the upstream's status if it answered, and the
    error (SPEC §3.2)."""

    status: int | None = None
    error: str | None = None


class LateResponse(NamedTuple):
    """A late response kept on attempt `number` of a job (SPEC §3.3), as `idemproxy store
    reseal` reads it: with its job's owner, id and key, which its seal is bound to."""

    owner: str
    job_id: str
    key: str
    number: int
    response: KeptResponse

    @property
    def job(self) -> Job:
        """The identity the seal binds (store/seal/codec.py), as a job."""
        return Job(self.job_id, self.owner, self.key, "", JobState.UNKNOWN, 0, 0)


def missing_key(job: Job, key_id: str) -> str:
    """The detail of a response sealed with a key the ring does not hold (SPEC §11)."""
    if not key_id:
        return (
            f"The stored response of job {job.id} has neither headers in the clear nor a key "
            "id: it was altered; the request was not forwarded."
        )
    return (
        f"The stored response of job {job.id} is sealed with key {key_id!r}, which is not in "
        "the proxy's key ring; the request was not forwarded."
    )


def key_of(response: KeptResponse | None) -> str | None:
    """The id of the key `response` is sealed with; None in the clear, or for a box whose key
    id was cleared (rows.py `NO_KEY_ID`), as its column holds."""
    return response.key_id or None if isinstance(response, SealedResponse) else None


class Store(abc.ABC):
    """A durable home for jobs and attempts."""

    def __init__(self) -> None:
        self.watch = JobWatch()
        # (operation, seconds, failed) for every call: the metrics hook (SPEC §13).
        self.observer: Callable[[str, float, bool], None] | None = None

    def observed(self, operation: str) -> AbstractContextManager[None]:
        """Times the block for `observer`; it failed if it raised StoreUnavailable."""
        return _Observed(self, operation)

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect (and start listening for changes made by other processes)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def migrate(self) -> list[str]:
        """Apply pending versioned migrations; returns the versions applied."""

    # --- the hot path -------------------------------------------------------------------------

    @abc.abstractmethod
    async def claim(
        self, intent: Intent, job_id: str, upstream: str, *, ttl: float, lease: float
    ) -> ClaimResult:
        """Create the job and its first attempt atomically, or return the job that exists."""

    @abc.abstractmethod
    async def claim_within(
        self,
        intent: Intent,
        job_id: str,
        upstream: str,
        *,
        ttl: float,
        lease: float,
        limits: QuotaLimits,
    ) -> ClaimResult | str:
        """`claim`, unless a new job would take its owner beyond `limits` (SPEC §9): then the
        name of that limit, and nothing is claimed. An existing key is never refused."""

    @abc.abstractmethod
    async def get(self, owner: str, key: str) -> Job | None: ...

    async def lookup(self, owner: str, key: str) -> Job | None:
        """The job as a claim would find it: from a replay cache in front when it has it, else
        this store's (quotas, SPEC §9: a duplicate is found before anything is counted)."""
        return await self.get(owner, key)

    @abc.abstractmethod
    async def watch_job(self, owner: str, key: str) -> Job | None:
        """The job, re-read after the caller subscribed to its changes, with its future state
        changes announced to every replica (SPEC §2.3: held duplicates)."""

    @abc.abstractmethod
    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        """CAS the job to `completed` with this attempt's response; False if another won."""

    @abc.abstractmethod
    async def settle(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> bool:
        """CAS the job to `released` or `unknown` after a failed attempt."""

    @abc.abstractmethod
    async def finish_attempt(
        self,
        job: Job,
        attempt: int,
        state: JobState,
        *,
        status: int | None = None,
        error: str | None = None,
    ) -> None:
        """Record one attempt's failure (`released` → failed, `unknown`) without touching the job,
        while other attempts of it still run (hedging, SPEC §3.4)."""

    @abc.abstractmethod
    async def start_next_attempt(
        self, job: Job, upstream: str, *, lease: float, token: str | None = None
    ) -> Claimed | None:
        """CAS a released job back to `in_flight` with a new attempt; None if another won.
        `token` (a UUID): recorded as the job's `started_by`, so that a caller whose statement's
        answer was lost can tell whether it committed (proxy/background/unsent.py)."""

    @abc.abstractmethod
    async def fail_over(
        self,
        job: Job,
        attempt: int,
        upstream: str,
        *,
        failure: AttemptFailure,
        lease: float,
        token: str | None = None,
    ) -> Claimed | None:
        """Attempt `attempt` failed without executing: start the next one on `upstream` in the
        same transaction, the job staying in flight (SPEC §3.4); None if the CAS lost. `token`:
        as in `start_next_attempt`."""

    @abc.abstractmethod
    async def add_attempt(self, job: Job, upstream: str, *, lease: float) -> int | None:
        """Start one more attempt under a job in flight (hedging); None if it left in_flight."""

    @abc.abstractmethod
    async def renew_lease(self, job: Job, *, lease: float) -> bool:
        """Extend the lease of a job in flight (SPEC §3.5); False once it is no longer ours."""

    @abc.abstractmethod
    async def take_over(self, job: Job) -> bool:
        """CAS a job whose lease expired to `unknown` (SPEC §3.5); exactly one caller wins."""

    @abc.abstractmethod
    async def forget(self, job: Job) -> bool:
        """Delete an expired terminal job (CAS on version) so its key can be claimed again."""

    # --- operators and housekeeping -----------------------------------------------------------

    @abc.abstractmethod
    async def get_by_id(self, job_id: str) -> Job | None:
        """The job with all its attempts."""

    @abc.abstractmethod
    async def late_response(self, job: Job, attempt: int) -> KeptResponse | None:
        """The response attempt `attempt` really had, kept when its completion lost the CAS
        to a takeover (SPEC §3.3); None if none was kept."""

    @abc.abstractmethod
    async def resolve(
        self,
        job: Job,
        state: JobState,
        *,
        response: KeptResponse | None = None,
        ttl: float = 0.0,
        resolution: str = "operator",
    ) -> bool:
        """CAS an `unknown` job to `completed` (with `response`) or `released` (SPEC §3.3)."""

    @abc.abstractmethod
    async def claim_check(self, job: Job, attempt: int, *, checks: int, due_after: float) -> bool:
        """SPEC §3.6: the right to ask once more about attempt `attempt` of `job`, while the job
        is `unknown` at `job.version`, the attempt was asked about `checks` times, and the last
        question (or its end, for the first) was at least `due_after` seconds ago by the
        database clock. A compare-and-swap: of several callers at once, one wins."""

    @abc.abstractmethod
    async def record_evidence(self, job: Job, attempt: int, evidence: Evidence) -> None:
        """SPEC §3.6: keep a question about attempt `attempt` and its answer on the attempt (the
        latest `MAX_EVIDENCE_ENTRIES`); read back by `get_by_id`."""

    @abc.abstractmethod
    async def note_sent(self, job: Job, attempt: int, digest: str) -> None:
        """SPEC §3.6: the digest of the request attempt `attempt` sends upstream."""

    @abc.abstractmethod
    async def resend(
        self, job: Job, attempt: int, upstream: str, *, window: float, lease: float, token: str
    ) -> Claimed | None:
        """SPEC §3.6: CAS an `unknown` job back to `in_flight` with a new attempt on
        `upstream`, sending the request again under the key the upstream honours; only while
        attempt `attempt` (the first that may have reached the upstream, where its window
        starts) started less than `window` seconds ago by the database clock. None if the CAS
        lost or the window has passed. `token`: as in `start_next_attempt`."""

    @abc.abstractmethod
    async def delete(self, job: Job, *, force: bool = False) -> bool:
        """CAS-delete the job at `job.version` with its attempts (SPEC §3.3); a job in flight
        whose lease is live by the database clock only with `force`. False: nothing deleted."""

    @abc.abstractmethod
    async def stale_unknown(self, older_than: float, limit: int) -> list[Job]:
        """Unknown jobs unchanged for `older_than` seconds (unknown_ttl, SPEC §3.3)."""

    @abc.abstractmethod
    async def expired_leases(self, older_than: float, limit: int) -> list[Job]:
        """Jobs in flight whose lease ran out at least `older_than` seconds ago by the
        database clock, oldest first (SPEC §3.5: taken over in the background)."""

    @abc.abstractmethod
    async def sweep_expired(self, batch_size: int) -> int:
        """Delete up to `batch_size` expired terminal jobs; returns how many."""

    @abc.abstractmethod
    async def list_jobs(
        self, *, state: JobState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[Job]: ...

    @abc.abstractmethod
    async def owner_jobs(
        self, owner: str, *, after: str, before: datetime, limit: int
    ) -> list[Job]:
        """Up to `limit` jobs of `owner` created before `before` with ids above `after`, in id
        order: a batch of an erasure (SPEC §11), without their attempts."""

    @abc.abstractmethod
    async def count_unknown(self) -> int: ...

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise `StoreUnavailable` unless the store answers."""

    def group_commits(self) -> tuple[GroupCommit[Any, Any], ...]:
        """The store's batchers (store/batching.py), for their metrics hook; none by default."""
        return ()

    # --- encryption at rest (SPEC §11, `idemproxy store reseal`) --------------------------------

    def opened(self, job: Job, response: KeptResponse) -> StoredResponse:
        """`response` of `job` in the clear. A store with no key ring refuses a sealed one
        (store/seal/store.py has the ring)."""
        if isinstance(response, StoredResponse):
            return response
        raise ResponseUnreadable(missing_key(job, response.key_id))

    @abc.abstractmethod
    async def to_reseal(self, primary: str | None, after: Job | None, limit: int) -> list[Job]:
        """Up to `limit` completed jobs whose response is not sealed with key `primary` (in the
        clear, or under another key), after `after` in the store's order: one batch."""

    @abc.abstractmethod
    async def reseal(self, job: Job, sealed: SealedResponse) -> bool:
        """Replace the response of `job` as read with `sealed` (CAS on its version and the key
        it was read with); False if the job changed, went, or was resealed meanwhile."""

    @abc.abstractmethod
    async def late_to_reseal(
        self, primary: str | None, after: LateResponse | None, limit: int
    ) -> list[LateResponse]:
        """As `to_reseal`, for the late responses kept on attempts (SPEC §3.3)."""

    @abc.abstractmethod
    async def reseal_late(self, late: LateResponse, sealed: SealedResponse) -> bool:
        """As `reseal`, for one late response (CAS on the key it was read with)."""

    def watching(self, job_id: str) -> AbstractAsyncContextManager[JobWatch.Subscription]:
        """Subscribe to changes of one job (SPEC §2.3: held duplicates)."""
        return self.watch.subscribe(job_id)


class _Observed(AbstractContextManager[None]):
    """`Store.observed` as a plain class: a generator-based context manager costs a generator
    and two extra frames on every store call."""

    __slots__ = ("_operation", "_started", "_store")

    def __init__(self, store: Store, operation: str) -> None:
        self._store = store
        self._operation = operation
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        observer = self._store.observer
        if observer is not None:
            failed = exc_type is not None and issubclass(exc_type, StoreUnavailable)
            observer(self._operation, time.perf_counter() - self._started, failed)
