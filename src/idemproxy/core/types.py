"""Plain data shared by the decision core, the stores and the proxy (SPEC §3)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

HeaderPairs = tuple[tuple[str, str], ...]


class JobState(enum.StrEnum):
    """SPEC §3.1."""

    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"
    RELEASED = "released"
    UNKNOWN = "unknown"


class AttemptState(enum.StrEnum):
    """SPEC §3.2."""

    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    DISCARDED = "discarded"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as kept for replay (SPEC §7). `body` is None when it was too large to keep."""

    status: int
    headers: HeaderPairs
    body: bytes | None

    @property
    def omitted(self) -> bool:
        return self.body is None


@dataclass(frozen=True, slots=True)
class SealedResponse:
    """A stored response sealed at rest (SPEC §11, encryption): its status and whether its
    body was omitted in the clear, its headers and body in `sealed`, an AEAD box under the key
    ring's key `key_id` bound to its job. Opened only to be replayed or shown."""

    status: int
    omitted: bool
    key_id: str
    sealed: bytes


# As a job holds it: in the clear, or sealed (encryption at rest).
KeptResponse = StoredResponse | SealedResponse


@dataclass(frozen=True, slots=True)
class Intent:
    """What a request asks for: its scope and fingerprint (SPEC §4-§6)."""

    owner: str
    key: str
    fingerprint: str
    method: str
    path: str
    # With `fingerprint_headers`, the fingerprint the same request had before that setting: a
    # job stored then still matches it (SPEC §6). Never stored.
    earlier_fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class Evidence:
    """One question about an `unknown` attempt and its answer (SPEC §3.6): `way` the way asked
    (core/resolution.py `Way`), `status` the answer's HTTP status (None: none came), `verdict`
    what it proved (`Verdict`) and `reason` why, in the proxy's words (never the answer's bytes:
    a response is kept only as the job's, sealed like any other, SPEC §11)."""

    way: str
    asked_at: datetime
    answered_at: datetime | None
    status: int | None
    verdict: str
    reason: str


@dataclass(frozen=True, slots=True)
class Attempt:
    number: int
    upstream: str
    state: AttemptState
    status: int | None = None
    error: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    # Bytes of the late response kept on this attempt (SPEC §3.3: its completion lost the CAS
    # to a takeover); None when none was kept. `Store.late_response` reads it.
    late_bytes: int | None = None
    # SPEC §3.6: how many times it was asked about since it became unknown, when last (by the
    # database clock), and the latest questions with their answers.
    checks: int = 0
    checked_at: datetime | None = None
    evidence: tuple[Evidence, ...] = ()
    # SPEC §3.6: the digest of the request it sent, kept on routes whose upstream honours keys.
    sent_digest: str | None = None


class Job(NamedTuple):
    """A snapshot of one job row. `version` is the compare-and-swap token (SPEC §1).

    Immutable like the other types here, but a named tuple rather than a frozen dataclass: every
    store call that returns a job builds one, and a frozen dataclass of 18 fields sets each
    through `object.__setattr__` (about 36,000 instructions a job against 13,000 for a tuple;
    bench/findings.md). Copies with changes: `job._replace(...)`."""

    id: str
    owner: str
    key: str
    fingerprint: str
    state: JobState
    version: int
    attempt_count: int
    method: str = ""
    path: str = ""
    completed_by: int | None = None
    response: KeptResponse | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    expires_at: datetime | None = None
    expired: bool = False
    # SPEC §3.5: in flight, but the lease of its attempts ran out by the database clock.
    lease_expired: bool = False
    # How an operator or unknown_ttl settled it (SPEC §3.3), if they did.
    resolution: str | None = None
    attempts: tuple[Attempt, ...] = ()
    # The token of the statement that started its current attempt, when that was
    # `start_next_attempt` or `fail_over` (a claim's is the job id): what lets the process whose
    # statement lost its answer find out whether that statement committed
    # (proxy/background/unsent.py).
    started_by: str | None = None


@dataclass(frozen=True, slots=True)
class Claimed:
    """The claim created the job and its first attempt: this request runs it."""

    job: Job
    attempt: int


@dataclass(frozen=True, slots=True)
class Existing:
    """The claim found a job for (owner, key) already."""

    job: Job


ClaimResult = Claimed | Existing
