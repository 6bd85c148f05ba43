"""The store's interfaces, each as narrow as its callers' needs (SPEC §11).

A request's path needs only `JobStore`, the hot path: the replay caches and the sealing of
responses wrap that and nothing else (store/layers.py). The operators (admin/, ops/), the
housekeeping tasks (proxy/background/), `idemproxy store reseal` and the process's start-up each
reach the store of record through their own interface. The PostgreSQL and SQLite stores
implement them all (`store.base.Store`).

Every method that changes a job is a compare-and-swap on the job's `version` (and names its
`owner`, so that every hot-path statement can be routed to one shard): it returns whether it
won, and a loser changes nothing. Driver errors never leave a store: each implementation
translates them into `StoreUnavailable` at one boundary.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any, NamedTuple, Protocol

from idemproxy.core.quota import QuotaLimits
from idemproxy.core.resolution import Backoff
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
from idemproxy.store.batching import GroupCommit
from idemproxy.store.watch import JobWatch

# (operation, seconds, failed) for every store call: the metrics hook (SPEC §13).
Observer = Callable[[str, float, bool], None]


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


class JobStore(Protocol):
    """The hot path: what one governed request does to its job (SPEC §2, §3)."""

    # Waiters on jobs, woken by every change feed (SPEC §2.3: held duplicates).
    watch: JobWatch

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

    @abc.abstractmethod
    async def lookup(self, owner: str, key: str) -> Job | None:
        """The job as a claim would find it: from a replay cache in front when it has it, else
        the store's (quotas, SPEC §9: a duplicate is found before anything is counted)."""

    @abc.abstractmethod
    async def watch_job(self, owner: str, key: str) -> Job | None:
        """The job, re-read after the caller subscribed to its changes, with its future state
        changes announced to every replica (SPEC §2.3: held duplicates)."""

    @abc.abstractmethod
    def watching(self, job_id: str) -> AbstractAsyncContextManager[JobWatch.Subscription]:
        """Subscribe to changes of one job (SPEC §2.3: held duplicates)."""

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

    @abc.abstractmethod
    async def delete(self, job: Job, *, force: bool = False) -> bool:
        """As `Operators.delete`: the request path deletes a job it has just claimed when the
        legacy owner's job for the key turns up (SPEC §5, `owner.legacy_owners`)."""

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
    async def note_sent(self, job: Job, attempt: int, digest: str) -> None:
        """SPEC §3.6: the digest of the request attempt `attempt` sends upstream."""

    @abc.abstractmethod
    async def get_by_id(self, job_id: str) -> Job | None:
        """As `Operators.get_by_id`: a retry of an `unknown` job reads its attempts before it
        may send it again (SPEC §3.6)."""

    @abc.abstractmethod
    async def record_evidence(self, job: Job, attempt: int, evidence: Evidence) -> None:
        """As `Housekeeping.record_evidence`: a retry that sent an `unknown` job again keeps
        what the upstream answered on the attempt it was about (SPEC §3.6)."""

    @abc.abstractmethod
    def opened(self, job: Job, response: KeptResponse) -> StoredResponse:
        """`response` of `job` in the clear, to be replayed (SPEC §11: only after the
        fingerprint matched); `ResponseUnreadable` if it does not open."""


class Operators(Protocol):
    """What an operator reads and decides (SPEC §3.3, §13: the admin API and `idemproxy jobs`)."""

    @abc.abstractmethod
    async def get(self, owner: str, key: str) -> Job | None: ...

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
    async def delete(self, job: Job, *, force: bool = False) -> bool:
        """CAS-delete the job at `job.version` with its attempts (SPEC §3.3); a job in flight
        whose lease is live by the database clock only with `force`. False: nothing deleted."""

    @abc.abstractmethod
    async def list_jobs(
        self, *, state: JobState | None = None, owner: str | None = None, limit: int = 100
    ) -> list[Job]: ...

    @abc.abstractmethod
    async def clock(self) -> datetime:
        """The database's clock now: what stamps a job's `created_at` (the cut-off of an
        erasure, SPEC §11, which no other host's clock may stand in for)."""

    @abc.abstractmethod
    async def owner_jobs(
        self, owner: str, *, after: str, before: datetime, limit: int
    ) -> list[Job]:
        """Up to `limit` jobs of `owner` created before `before` with ids above `after`, in id
        order: a batch of an erasure (SPEC §11), without their attempts."""

    @abc.abstractmethod
    async def count_unknown(self) -> int: ...

    @abc.abstractmethod
    def opened(self, job: Job, response: KeptResponse) -> StoredResponse:
        """As `JobStore.opened`: for an operator who asks to see the response (SPEC §11)."""


class Housekeeping(Protocol):
    """The background tasks' reads and writes (SPEC §3.3 `unknown_ttl`, §3.5, §11 expiry)."""

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
    async def due_unknown(self, backoff: Backoff, *, after: str, limit: int) -> list[Job]:
        """SPEC §3.6: up to `limit` `unknown` jobs, with ids above `after` in id order, whose
        unknown attempts (core/resolution.py `asked_attempts`) one is due a question under `backoff`
        by the database clock: one page of them, without their attempts."""

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


class Resealing(Protocol):
    """`idemproxy store reseal`: every response sealed with the primary key (SPEC §11)."""

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


class Lifecycle(Protocol):
    """What the process does with the store as a whole: open it, migrate it, ask whether it
    answers (readiness), time its calls, close it."""

    observer: Observer | None

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect (and start listening for changes made by other processes)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def migrate(self) -> list[str]:
        """Apply pending versioned migrations; returns the versions applied."""

    @abc.abstractmethod
    async def ping(self) -> bool:
        """Whether the store takes writes now; False when it answers but only reads (a hot
        standby, a server or session made read-only, a database file that cannot be written):
        every claim would fail. `StoreUnavailable` unless it answers."""

    @abc.abstractmethod
    def group_commits(self) -> tuple[GroupCommit[Any, Any], ...]:
        """The store's batchers (store/batching.py), for their metrics hook."""
