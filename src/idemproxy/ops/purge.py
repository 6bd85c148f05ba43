"""Erasure: every job and attempt of one owner, on request (SPEC §11, GDPR Art. 17).

The purge walks the owner's jobs in id order, a bounded batch at a time, and deletes each with
the operator's compare-and-swap delete (`Store.delete`), so that every cache learns of it as of
any delete: the Redis entry is dropped and tombstoned, and the change feed (PostgreSQL NOTIFY,
the Redis channel) tells every replica's in-process cache to forget it.

A job in flight or `unknown` may have executed, or be executing: deleting it lets a retry run
again. Such jobs are left and listed unless the operator asks for them too
(`include_in_flight`). Jobs claimed after the purge began are not touched, so that a busy owner
cannot keep a purge running for ever and a request sent meanwhile is never cut off: "began" is
the database's clock, which stamps every job's `created_at`, read once at the start.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from idemproxy.config.settings import OwnerSettings
from idemproxy.core.types import Job, JobState
from idemproxy.errors import InvalidRequest, OwnerMissing, OwnerUnstable
from idemproxy.identity.intent import derive_owners, owner_policy
from idemproxy.identity.jwt_owner import KeyNotLoaded
from idemproxy.ops.service import owner_filter
from idemproxy.store.ports import Operators

log = logging.getLogger(__name__)
DEFAULT_BATCH_SIZE = 100
MAX_BATCH_SIZE = 1000
# Whitespace HTTP strips around a field value (RFC 9110 §5.5): the proxy never sees it in a
# credential. No value holds a line break or a NUL (RFC 9110 §5.5, RFC 9112 §5).
_OWS = " \t"
_NEVER_IN_A_VALUE = frozenset("\r\n\0")
# Below every job id: the cursor before the first batch.
_FIRST_ID = "00000000-0000-0000-0000-000000000000"
_RISKY = (JobState.IN_FLIGHT, JobState.UNKNOWN)


@dataclass(frozen=True, slots=True)
class LeftJob:
    """A job the purge did not delete, and why."""

    id: str
    state: str
    reason: str


@dataclass(slots=True)
class PurgeReport:
    owner: str
    removed_jobs: int = 0
    removed_attempts: int = 0
    removed_by_state: Counter[str] = field(default_factory=Counter)
    left: list[LeftJob] = field(default_factory=list)
    batches: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "owner": self.owner,
            "removed_jobs": self.removed_jobs,
            "removed_attempts": self.removed_attempts,
            "removed_by_state": dict(sorted(self.removed_by_state.items())),
            "left": [{"id": j.id, "state": j.state, "reason": j.reason} for j in self.left],
            "batches": self.batches,
        }


def owners_of_credential(credential: str, settings: OwnerSettings) -> tuple[str, str | None]:
    """The owner scope the proxy derives from `credential` (the owner header's value) under
    the configured strategy, hashed exactly as the proxy hashes it (identity/intent.py); and in
    the transition to `owner.pepper` (`legacy_owners`), the owner it had before, whose jobs are
    the same customer's (SPEC §5), else None."""
    credential = credential.strip(_OWS)  # as the proxy's parser hands the value over
    if not credential:  # the anonymous scope is named as `--owner anonymous`, never by accident
        raise InvalidRequest("the credential is empty")
    if not _NEVER_IN_A_VALUE.isdisjoint(credential):
        raise InvalidRequest(
            "the credential holds a line break or a NUL, which no header value can: no client "
            "sent it (a credential file has it on one line)"
        )
    policy = owner_policy(settings)
    if policy.header is None:
        raise InvalidRequest("owner.strategy none has one global scope and no credentials")
    try:
        return derive_owners(policy, {policy.header: credential})
    except OwnerMissing as exc:
        raise InvalidRequest("the credential does not verify") from exc
    except OwnerUnstable as exc:  # SPEC §5: no job was ever claimed under such a credential
        raise InvalidRequest("the credential is a signature made for one request") from exc
    except KeyNotLoaded as exc:  # keys from an identity provider are fetched by `serve` only
        raise InvalidRequest(
            "the token's key is not loaded here (an identity provider's keys): name the owner "
            "by its hash (--owner), as `idemproxy jobs list` shows it"
        ) from exc


async def purge_owner(
    store: Operators,
    owner: str,
    *,
    include_in_flight: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> PurgeReport:
    """Delete every job of `owner` claimed before now; the report says what went, and lists
    what stayed (in flight or unknown without `include_in_flight`, or changed meanwhile)."""
    owner = owner_filter(owner)
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise InvalidRequest(f"batch size must be from 1 to {MAX_BATCH_SIZE}")
    report = PurgeReport(owner)
    before, after = await store.clock(), _FIRST_ID
    while batch := await store.owner_jobs(owner, after=after, before=before, limit=batch_size):
        report.batches += 1
        for job in batch:
            await _purge_one(store, job, report, include_in_flight=include_in_flight)
        after = batch[-1].id
    log.info(
        "owner %s… purged: %d jobs and %d attempts removed, %d left",
        owner[:8],
        report.removed_jobs,
        report.removed_attempts,
        len(report.left),
    )
    return report


async def _purge_one(
    store: Operators, job: Job, report: PurgeReport, *, include_in_flight: bool
) -> None:
    if job.state in _RISKY and not include_in_flight:
        report.left.append(LeftJob(job.id, job.state.value, "may have executed or be executing"))
        return
    if await store.delete(job, force=include_in_flight):
        report.removed_jobs += 1
        report.removed_attempts += job.attempt_count
        report.removed_by_state[job.state.value] += 1
        return
    after = await store.get_by_id(job.id)
    if after is None:
        return  # swept or deleted by someone else meanwhile: gone all the same
    if after.state in _RISKY and not include_in_flight:
        report.left.append(LeftJob(after.id, after.state.value, "restarted during the purge"))
        return
    # Changed between the read and the delete (a completion): once more, at its new version.
    if await store.delete(after, force=include_in_flight):
        report.removed_jobs += 1
        report.removed_attempts += after.attempt_count
        report.removed_by_state[after.state.value] += 1
    else:
        report.left.append(LeftJob(after.id, after.state.value, "changed during the purge"))
