"""The admin jobs API (SPEC §3.3, §13): list, show, resolve and delete jobs.

    GET    /jobs?state=&owner=&limit=     newest first, each with its attempts
    GET    /jobs/{id}[?include=response]  one job; the stored body only when asked for
    POST   /jobs/find                     {"key": …} and {"owner": …}, {"credential": …} or
                                          {"sender": …}, optionally "include_response": the job
                                          of a client's key in that owner's scope
    POST   /jobs/{id}/resolve             {"as": "released"} or {"as": "completed", "status": …}
                                          or {"as": "completed", "from_attempt": N}
    DELETE /jobs/{id}[?force=true][&version=N]  204 (a CAS on the version read, or N)
    POST   /owners/purge                  {"owner": …} or {"credential": …}, optionally
                                          "include_in_flight", "batch_size": the report

Every route sits behind the admin bearer token (`admin.app`); errors are RFC 9457 problems.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from idemproxy.config.settings import Settings
from idemproxy.core.types import JobState
from idemproxy.errors import InvalidRequest, ProblemError
from idemproxy.http.offload import off_loop
from idemproxy.http.problems import problem_response
from idemproxy.ops import purge, service
from idemproxy.ops.invalidations import PendingInvalidations, invalidations_left, mark
from idemproxy.ops.resolution import ResponseRules, resolution_from_json
from idemproxy.ops.view import job_to_json
from idemproxy.store.ports import Operators

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
# Room for a `max_stored_body` response sent as base64 (4/3) plus the rest of the JSON.
_JSON_OVERHEAD = 64 * 1024

JOBS_STORE = web.AppKey("idemproxy.admin.jobs.store", Operators)
JOBS_SETTINGS = web.AppKey("idemproxy.admin.jobs.settings", Settings)
# The proxies' Redis cache, when there is one: its invalidations not yet through.
JOBS_INVALIDATIONS = web.AppKey("idemproxy.admin.jobs.invalidations", PendingInvalidations)

_LIST_PARAMETERS = frozenset({"state", "owner", "limit"})
_SHOW_PARAMETERS = frozenset({"include"})
_DELETE_PARAMETERS = frozenset({"force", "version"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_jobs_routes(
    app: web.Application,
    settings: Settings,
    store: Operators,
    invalidations: PendingInvalidations | None = None,
) -> None:
    app[JOBS_STORE] = store
    app[JOBS_SETTINGS] = settings
    if invalidations is not None:
        app[JOBS_INVALIDATIONS] = invalidations
    app.router.add_get("/jobs", _problems(_list))
    app.router.add_get("/jobs/{id}", _problems(_show))
    app.router.add_post("/jobs/find", _problems(_find))
    app.router.add_post("/jobs/{id}/resolve", _problems(_resolve))
    app.router.add_delete("/jobs/{id}", _problems(_delete))
    app.router.add_post("/owners/purge", _problems(_purge))


def client_max_size(settings: Settings) -> int:
    """The admin app's request size limit: a resolution may carry a whole stored body."""
    return max(1024**2, settings.max_stored_body * 4 // 3 + _JSON_OVERHEAD)


def _problems(handler: Handler) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProblemError as error:
            return problem_response(error)

    return answer


async def _list(request: web.Request) -> web.Response:
    query = _query(request, _LIST_PARAMETERS)
    jobs = await service.list_jobs(
        request.app[JOBS_STORE],
        state=_state(query.get("state")),
        owner=query.get("owner") or None,
        limit=_limit(query.get("limit")),
    )
    return _json([job_to_json(job) for job in jobs])


async def _show(request: web.Request) -> web.Response:
    include = _query(request, _SHOW_PARAMETERS).get("include", "")
    if include not in ("", "response"):
        raise InvalidRequest('include must be "response"')
    store = request.app[JOBS_STORE]
    job = await service.find_job(store, request.match_info["id"])
    if include != "response":
        return _json(job_to_json(job))
    late = await service.late_responses(store, job)
    return _json(job_to_json(service.shown(store, job), include_response=True, late=late))


_FIND_FIELDS = frozenset({"key", "owner", "credential", "sender", "include_response"})
_FIND_OWNERS = ("owner", "credential", "sender")


async def _find(request: web.Request) -> web.Response:
    """The job of a client's key: a POST, so that a credential never sits in a URL (and in
    every access log between the operator and here)."""
    body = await _json_body(request)
    if not isinstance(body, dict) or set(body) - _FIND_FIELDS:
        raise InvalidRequest(f"the body must be an object of {', '.join(sorted(_FIND_FIELDS))}")
    given = [name for name in _FIND_OWNERS if body.get(name) is not None]
    key, include = body.get("key"), body.get("include_response", False)
    if len(given) != 1 or not all(isinstance(body[name], str) for name in given):
        raise InvalidRequest("give one of owner (the hash), credential or sender, a string")
    if not isinstance(key, str) or not isinstance(include, bool):
        raise InvalidRequest("key must be a string and include_response a boolean")
    [how] = given
    owners: tuple[str, str | None] = (body[how], None)
    if how == "sender":
        owners = (service.sender_owner(body[how]), None)
    elif how == "credential":
        owners = purge.owners_of_credential(body[how], request.app[JOBS_SETTINGS].owner)
    store = request.app[JOBS_STORE]
    job = await service.find_by_key(store, key, owners)
    if not include:
        return _json(job_to_json(job))
    late = await service.late_responses(store, job)
    return _json(job_to_json(service.shown(store, job), include_response=True, late=late))


async def _resolve(request: web.Request) -> web.Response:
    settings = request.app[JOBS_SETTINGS]
    rules = ResponseRules.from_settings(settings)
    resolution = resolution_from_json(await _json_body(request), rules)
    job = await service.resolve_job(
        request.app[JOBS_STORE],
        request.match_info["id"],
        resolution,
        default_ttl=settings.ttl,
    )
    return _json(job_to_json(job))


async def _delete(request: web.Request) -> web.Response:
    query = _query(request, _DELETE_PARAMETERS)
    cache = request.app.get(JOBS_INVALIDATIONS)
    since = mark(cache)
    await service.delete_job(
        request.app[JOBS_STORE],
        request.match_info["id"],
        force=_flag(query.get("force"), "force"),
        version=_version(query.get("version")),
    )
    left = await invalidations_left(cache, since, mark(cache))
    if left:
        return web.json_response({"redis_entries_pending": left, "detail": _PENDING}, status=202)
    return web.Response(status=204)


# SPEC §11, Erasure: the store's change is made, the cache's is not yet whole.
_PENDING = (
    "Deleted in the store; Redis did not take the invalidation of these entries. This proxy "
    "retries every second while it runs and reads nothing from Redis meanwhile; the other "
    "proxies may replay them until redis.ttl runs out. If this proxy stops first, remove them "
    "from Redis by hand."
)


_PURGE_FIELDS = frozenset({"owner", "credential", "include_in_flight", "batch_size"})


async def _purge(request: web.Request) -> web.Response:
    """SPEC §11: erase one owner's jobs. 200 with the report; `left` lists what stayed; 202
    when the proxies' Redis did not take every invalidation (`redis_entries_pending`)."""
    body = await _json_body(request)
    if not isinstance(body, dict) or set(body) - _PURGE_FIELDS:
        raise InvalidRequest(f"the body must be an object of {', '.join(sorted(_PURGE_FIELDS))}")
    owner, credential = body.get("owner"), body.get("credential")
    if (owner is None) == (credential is None):
        raise InvalidRequest("give one of owner (the hash) or credential")
    legacy = None
    if credential is not None:
        if not isinstance(credential, str):
            raise InvalidRequest("credential must be a string")
        owner, legacy = purge.owners_of_credential(credential, request.app[JOBS_SETTINGS].owner)
    include, size = body.get("include_in_flight", False), body.get("batch_size")
    if not isinstance(owner, str) or not isinstance(include, bool):
        raise InvalidRequest("owner must be a string and include_in_flight a boolean")
    if size is None:
        size = purge.DEFAULT_BATCH_SIZE
    if not isinstance(size, int) or isinstance(size, bool):
        raise InvalidRequest("batch_size must be an integer")
    store, cache = request.app[JOBS_STORE], request.app.get(JOBS_INVALIDATIONS)
    since = mark(cache)
    report = await purge.purge_owner(store, owner, include_in_flight=include, batch_size=size)
    answer = report.to_json()
    if legacy is not None:  # SPEC §5: the owner the credential had before `owner.pepper`
        legacy_report = await purge.purge_owner(
            store, legacy, include_in_flight=include, batch_size=size
        )
        answer["legacy"] = legacy_report.to_json()
    left = await invalidations_left(cache, since, mark(cache))
    answer["redis_entries_pending"] = left
    if left:
        answer["detail"] = _PENDING
    return web.json_response(answer, status=202 if left else 200)


def _state(value: str | None) -> JobState | None:
    if not value:
        return None
    try:
        return JobState(value)
    except ValueError:
        states = ", ".join(s.value for s in JobState)
        raise InvalidRequest(f"state must be one of {states}") from None


def _query(request: web.Request, allowed: frozenset[str]) -> dict[str, str]:
    """The query parameters, each given at most once, none unknown: a misspelt filter
    (`?states=unknown`) would otherwise list every job as if it matched."""
    query = request.query
    unknown = sorted(set(query) - allowed)
    if unknown:
        raise InvalidRequest(
            f"unknown query parameter {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}"
        )
    if len(query) != len(set(query)):
        raise InvalidRequest("each query parameter may be given once")
    return dict(query)


def _flag(value: str | None, name: str) -> bool:
    if value is None or value in ("", "0", "false"):
        return False
    if value in ("1", "true"):
        return True
    raise InvalidRequest(f"{name} must be true or false")


def _version(value: str | None) -> int | None:
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 9:
        raise InvalidRequest("version must be a positive integer")
    return int(value)


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_LIMIT}")
    return int(value)


async def _json_body(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise InvalidRequest("the body is too large; see max_stored_body") from exc
    try:
        # http/offload.py: a resolution may carry a whole stored body, up to ~11 MiB.
        return await off_loop(raw, json.loads, raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("the body must be JSON") from exc
    except RecursionError as exc:  # no resolution is nested so deep
        raise InvalidRequest("the body is nested too deeply") from exc


def _json(data: Any) -> web.Response:
    return web.json_response(data)
