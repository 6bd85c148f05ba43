"""Operator actions on the store, shared by the admin API and the CLI (SPEC §3.3, §13).

Each action reads the job, checks what an operator may do with it, then changes it by
compare-and-swap; a loser changes nothing and says why.
"""

from __future__ import annotations

import logging
import re
import string

from idemproxy.constants import (
    ANONYMOUS_OWNER,
    GLOBAL_OWNER,
    KEY_MAX_LENGTH,
    OWNER_FILTER_MAX_LENGTH,
    RESOLUTION_OPERATOR,
    WEBHOOK_OWNER_PREFIX,
)
from idemproxy.core.types import Job, JobState, KeptResponse, StoredResponse
from idemproxy.errors import (
    DeletionLost,
    InvalidRequest,
    JobInFlight,
    JobNotFound,
    JobNotUnknown,
    NoLateResponse,
    ResolutionLost,
    ResponseUnreadable,
    VersionMismatch,
)
from idemproxy.ops.resolution import Resolution
from idemproxy.store.ports import Operators

log = logging.getLogger(__name__)
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
OWNER_HASH_DIGITS = 64  # a SHA-256 in hex (identity/intent.py)


async def find_job(store: Operators, job_id: str) -> Job:
    """The job with its attempts."""
    job = await store.get_by_id(job_id)
    if job is None:
        raise JobNotFound(f"job {job_id} not found")
    return job


async def list_jobs(
    store: Operators, *, state: JobState | None, owner: str | None, limit: int
) -> list[Job]:
    """Newest first, each with its attempts (SPEC §13: a listed job has them too)."""
    if owner is not None:
        owner = owner_filter(owner)
    listed = await store.list_jobs(state=state, owner=owner, limit=limit)
    full = [await store.get_by_id(job.id) for job in listed]
    return [job for job in full if job is not None]  # deleted meanwhile: gone from the list


async def find_by_key(store: Operators, key: str, owners: tuple[str, str | None]) -> Job:
    """The job of the client's `key` in the owner's scope (support's "what happened to
    order-1234?"); the legacy owner's too, during a switch to `owner.pepper` (SPEC §5). Always
    a point lookup on `(owner, key)`: never a search of every owner's keys."""
    if not (0 < len(key) <= KEY_MAX_LENGTH and _VISIBLE_ASCII.fullmatch(key)):
        raise InvalidRequest(
            f"key must be 1-{KEY_MAX_LENGTH} visible ASCII characters, as the client sent it "
            "(with the route's prefix, if its key source has one)"
        )
    for named in filter(None, owners):
        owner = owner_filter(named)
        found = await store.get(owner, key)
        if found is not None:
            return await find_job(store, found.id)  # with its attempts
    raise JobNotFound(f"no job of this owner has the key {key}")


def sender_owner(sender: str) -> str:
    """The owner scope of a webhook route's deliveries: its configured sender name (SPEC §4.2)."""
    return WEBHOOK_OWNER_PREFIX + sender


def owner_filter(owner: str) -> str:
    """An owner as the store keeps it, checked before it reaches the store: a hash in
    lower-case hex, as identity/intent.py writes it, whatever the case it was given in;
    `anonymous`, `global` or `webhook:<sender>`. Anything else names no owner, and is refused
    rather than matched to nothing, which would read as "no jobs" (and, for an erasure, as
    done): a hash's first 8 digits or `owner=` and them, as a log line shows them, a hash with a
    stray character. A NUL would also be refused by PostgreSQL (a 503 and a store error,
    which operators alert on)."""
    if not (0 < len(owner) <= OWNER_FILTER_MAX_LENGTH and _VISIBLE_ASCII.fullmatch(owner)):
        raise InvalidRequest(
            f"owner must be 1-{OWNER_FILTER_MAX_LENGTH} visible ASCII characters "
            "(the owner hash, as shown by show)"
        )
    if owner in (ANONYMOUS_OWNER, GLOBAL_OWNER) or (
        owner.startswith(WEBHOOK_OWNER_PREFIX) and owner != WEBHOOK_OWNER_PREFIX
    ):
        return owner
    if len(owner) != OWNER_HASH_DIGITS or not all(c in string.hexdigits for c in owner):
        raise InvalidRequest(
            f"{owner!r} is not an owner: give the owner hash, all {OWNER_HASH_DIGITS} hex "
            "digits (log lines show the first 8; `jobs show JOB_ID`, the job= of the line, "
            f"prints them all), or {ANONYMOUS_OWNER}, {GLOBAL_OWNER} or "
            f"{WEBHOOK_OWNER_PREFIX}<sender>"
        )
    return owner.lower()


async def resolve_job(
    store: Operators, job_id: str, resolution: Resolution, *, default_ttl: float
) -> Job:
    """SPEC §3.3: CAS an `unknown` job to `completed` or `released`; one of many callers wins."""
    job = await find_job(store, job_id)
    _check_version(job, resolution.version)
    if job.state is not JobState.UNKNOWN:
        raise JobNotUnknown(
            f"job {job.id} is {job.state.value}; only an unknown job can be resolved; "
            "nothing was changed"
        )
    response: KeptResponse | None = resolution.response
    if resolution.from_attempt is not None:
        response = await _late_response(store, job, resolution.from_attempt)
    won = await store.resolve(
        job,
        resolution.state,
        response=response,
        ttl=resolution_ttl(job, default_ttl),
        resolution=RESOLUTION_OPERATOR,
    )
    if not won:
        raise ResolutionLost(
            f"job {job.id} changed while it was being resolved (someone else won the "
            "compare-and-swap); nothing was changed"
        )
    log.info("job %s: resolved as %s by an operator", job.id, resolution.state.value)
    after = await store.get_by_id(job.id)
    return after or job._replace(
        state=resolution.state, version=job.version + 1, resolution=RESOLUTION_OPERATOR
    )


async def delete_job(
    store: Operators, job_id: str, *, force: bool = False, version: int | None = None
) -> Job:
    """Delete a job and its attempts; its key can then be claimed afresh.

    A compare-and-swap on the version read (or `version`, when the operator names the one they
    saw): a job that changed in between, e.g. a released job a retry restarted, is not deleted.
    """
    job = await find_job(store, job_id)
    _check_version(job, version)
    if _running(job) and not force:
        raise _in_flight(job)
    if await store.delete(job, force=force):
        log.info("job %s: deleted by an operator (it was %s)", job.id, job.state.value)
        return job
    after = await store.get_by_id(job.id)
    if after is None:
        raise JobNotFound(f"job {job_id} not found")
    if after.version == job.version and _running(after) and not force:
        raise _in_flight(after)  # its lease was renewed (by the database clock) meanwhile
    raise DeletionLost(
        f"job {job.id} changed while it was being deleted (now {after.state.value}, version "
        f"{after.version}); nothing was deleted"
    )


def _check_version(job: Job, version: int | None) -> None:
    if version is not None and version != job.version:
        raise VersionMismatch(
            f"job {job.id} is at version {job.version}, not {version}; nothing was changed"
        )


def _running(job: Job) -> bool:
    return job.state is JobState.IN_FLIGHT and not job.lease_expired


def _in_flight(job: Job) -> JobInFlight:
    # An attempt is running: without the job, a retry would claim the key and run again.
    return JobInFlight(
        f"job {job.id} is in flight with a live lease; deleting it could let a retry run "
        "a second time (force to delete anyway)"
    )


async def _late_response(store: Operators, job: Job, number: int) -> KeptResponse:
    if not any(a.number == number for a in job.attempts):
        raise InvalidRequest(f"job {job.id} has no attempt {number}")
    kept = await store.late_response(job, number)
    if kept is None:
        raise NoLateResponse(
            f"attempt {number} of job {job.id} kept no response (only a response that came "
            "after the job was taken over is kept, within max_stored_body per job); nothing "
            "was changed"
        )
    if isinstance(kept, StoredResponse):
        # SPEC §11: under `encryption.require_sealed` one in the clear is refused here, as its
        # replay would be; sealed now, a planted response would be replayed as the job's.
        kept = store.opened(job, kept)
    return kept


async def late_responses(store: Operators, job: Job) -> dict[int, KeptResponse]:
    """The late responses kept on the job's attempts, by attempt number (for `show`), opened
    when they are sealed and their key is in the ring (SPEC §11)."""
    kept = {}
    for attempt in job.attempts:
        if attempt.late_bytes is not None:
            response = await store.late_response(job, attempt.number)
            if response is not None:
                kept[attempt.number] = readable(store, job, response)
    return kept


def shown(store: Operators, job: Job) -> Job:
    """`job` with its response opened for an operator who asked to see it (SPEC §11); one that
    does not open stays sealed, and is shown as such."""
    if job.response is None:
        return job
    return job._replace(response=readable(store, job, job.response))


def readable(store: Operators, job: Job, response: KeptResponse) -> KeptResponse:
    try:
        return store.opened(job, response)
    except ResponseUnreadable as exc:
        log.warning("job %s: %s", job.id, exc.detail)
        return response


def resolution_ttl(job: Job, default: float) -> float:
    """A resolved job lives as long as its route's jobs do: the ttl it was claimed with.

    An `unknown` job was never completed, so its `expires_at` is still the claim's.
    """
    if job.created_at is not None and job.expires_at is not None:
        claimed_for = (job.expires_at - job.created_at).total_seconds()
        if claimed_for > 0:
            return claimed_for
    return default
