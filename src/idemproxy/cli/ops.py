"""`idemproxy jobs list|show|resolve|delete|purge` and `idemproxy store reseal`: operators
working directly on the store (SPEC §11, §13).

Exit status: 0 done; 1 the job was not found or the change lost (not unknown, changed, resolved
by someone else first, in flight), a purge left jobs (listed), the store failed, or the change
was made but the proxies' Redis did not take its invalidation (the entries are named); 2 bad
usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from idemproxy.cli.help import describe_setting_flags
from idemproxy.config.settings import Settings, load_settings
from idemproxy.core.types import Job, JobState
from idemproxy.errors import (
    ConfigError,
    InvalidRequest,
    OperatorError,
    StoreUnavailable,
    StoreUnreachable,
)
from idemproxy.ops import purge, service
from idemproxy.ops.invalidations import invalidations_left, unsent_remedy
from idemproxy.ops.reseal import report_lines, reseal_store
from idemproxy.ops.resolution import (
    Resolution,
    ResponseRules,
    completed,
    from_attempt,
    parse_header_line,
    released,
)
from idemproxy.ops.table import job_details, jobs_table
from idemproxy.ops.view import job_to_json
from idemproxy.store.factory import (
    command_store,
    redis_layer,
    sqlite_path,
    wrap_with_cache,
    wrap_with_seal,
)
from idemproxy.store.layers import StoreStack
from idemproxy.store.ports import Operators
from idemproxy.store.seal.store import SealingStore

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_MAX_LIMIT = 1000
# Only the store and the stored-response rules matter here: no upstream is needed.
_NO_UPSTREAM = "http://jobs.invalid"

# An operator's command: on the store of record, whose hooks reach the caches given (SPEC §11).
Action = Callable[[argparse.Namespace, Operators, Settings], Awaitable[None]]


class ResealIncomplete(Exception):
    """Some responses could not be resealed (printed already)."""


def add_jobs_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `jobs list|show|resolve|delete` on the top-level subparsers."""
    jobs = commands.add_parser("jobs", help="list, inspect and resolve jobs in the store")
    actions = jobs.add_subparsers(required=True, metavar="ACTION")
    _add_list(_store_flags(actions.add_parser("list", help="newest jobs first")))
    _add_show(_store_flags(actions.add_parser("show", help="one job and its attempts")))
    _add_find(
        _store_flags(
            actions.add_parser("find", help="the job of a client's key, in one owner's scope")
        )
    )
    _add_resolve(_store_flags(actions.add_parser("resolve", help="settle an unknown job")))
    _add_delete(_store_flags(actions.add_parser("delete", help="delete a job")))
    _add_purge(_store_flags(actions.add_parser("purge", help="erase every job of one owner")))


def add_store_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `store reseal` (SPEC §11, encryption at rest) on the top-level subparsers."""
    store = commands.add_parser("store", help="maintain what the store holds")
    actions = store.add_subparsers(required=True, metavar="ACTION")
    reseal = _store_flags(
        actions.add_parser(
            "reseal",
            help="seal every stored response with the primary key of encryption.keys",
            description="Seals every stored response (and late response) that is in the clear"
            " or under an older key with the first key of encryption.keys, in batches, while"
            " the proxies serve. Exit status 1 when some response's key is not in the ring.",
        )
    )
    reseal.add_argument(
        "--batch-size", type=_limit, default=100, metavar="N", help="rows per batch"
    )
    reseal.add_argument(
        "--pause",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds to wait between batches, leaving the store to the proxies",
    )
    reseal.set_defaults(run=_runner(_reseal))


def _store_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--store", metavar="DSN", help="the store, else the one in --config")
    parser.add_argument(
        "--redis",
        metavar="URL",
        help="the proxies' Redis, if any, else the one in --config: a delete or resolution then"
        " also invalidates its replay cache",
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        default=os.environ.get("IDEMPROXY_CONFIG"),
        help="YAML settings file",
    )
    describe_setting_flags(parser, {"store": "store", "redis": "redis.url"})
    return parser


def _add_list(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state", choices=[s.value for s in JobState], help="only jobs in it")
    parser.add_argument(
        "--owner", type=_owner, metavar="OWNER", help="the owner hash, as shown by show"
    )
    parser.add_argument("--limit", type=_limit, default=100, metavar="N", help="default 100")
    parser.add_argument("--json", action="store_true", help="an array of jobs (SPEC §13)")
    parser.set_defaults(run=_runner(_on_record(_list)))


def _add_show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", metavar="JOB_ID")
    parser.add_argument("--json", action="store_true", help="one job (SPEC §13)")
    parser.add_argument(
        "--include-response",
        action="store_true",
        help="also print the stored response's headers and body (may hold a tenant's data)",
    )
    parser.set_defaults(run=_runner(_on_record(_show)))


def _owner_flags(parser: argparse.ArgumentParser, *, sender: bool = False) -> None:
    """--owner HASH or --credential-file FILE (or --sender NAME), exactly one of them."""
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--owner", type=_owner, metavar="OWNER", help="the owner hash, as shown by show"
    )
    who.add_argument(
        "--credential-file",
        metavar="FILE",
        help="the owner's credential (its Authorization or owner header value), hashed as the"
        " proxy hashes it under owner.* of --config; - for stdin",
    )
    if sender:
        who.add_argument("--sender", metavar="NAME", help="a webhook route's sender (webhook.name)")


def _add_find(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("key", metavar="KEY", help="the key as the client sent it")
    _owner_flags(parser, sender=True)
    parser.add_argument("--json", action="store_true", help="one job (SPEC §13)")
    parser.add_argument(
        "--include-response",
        action="store_true",
        help="also print the stored response's headers and body (may hold a tenant's data)",
    )
    parser.set_defaults(run=_runner(_on_record(_find)))


def _add_resolve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", metavar="JOB_ID")
    parser.add_argument(
        "--as",
        dest="as_",
        required=True,
        choices=["released", "completed"],
        help="released: a retry executes again; completed: retries get the given response",
    )
    parser.add_argument(
        "--status", type=int, metavar="N", help="the response's status, with --as completed"
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'Name: value'",
        help="a response header, with --as completed (repeatable)",
    )
    parser.add_argument("--body-file", metavar="FILE", help="the response body; - for stdin")
    parser.add_argument(
        "--from-attempt",
        type=int,
        metavar="N",
        help="with --as completed: the response attempt N really had, kept when it came too late"
        " (see show); no --status, --header or --body-file then",
    )
    parser.add_argument(
        "--expect-version", type=int, metavar="N", help="refuse if the job is not at version N"
    )
    parser.add_argument("--json", action="store_true", help="print the resolved job")
    parser.set_defaults(run=_runner(_on_record(_resolve)))


def _add_delete(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", metavar="JOB_ID")
    parser.add_argument(
        "--force", action="store_true", help="even a job in flight whose lease is live"
    )
    parser.add_argument(
        "--expect-version", type=int, metavar="N", help="refuse if the job is not at version N"
    )
    parser.set_defaults(run=_runner(_on_record(_delete)))


def _add_purge(parser: argparse.ArgumentParser) -> None:
    _owner_flags(parser)
    parser.add_argument(
        "--include-in-flight",
        action="store_true",
        help="also delete jobs in flight or unknown (a retry of one may then run again);"
        " without it they are left and listed",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=purge.DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"jobs read per batch, default {purge.DEFAULT_BATCH_SIZE}",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=_runner(_on_record(_purge)))


_PURGE_WITHOUT_REDIS = (
    "warning: no Redis given (--redis or redis.url): entries of the purged jobs in a Redis the"
    " proxies use stay there, and are replayed, until their redis.ttl runs out"
)


async def _purge(args: argparse.Namespace, store: Operators, settings: Settings) -> None:
    if settings.redis.url is None:  # SPEC §11, Erasure: it cannot reach the proxies' Redis
        print(_PURGE_WITHOUT_REDIS, file=sys.stderr)
    owners: tuple[str, str | None] = (args.owner, None)
    if args.owner is None:
        credential = _body(args.credential_file).decode("utf-8", "surrogateescape")
        owners = purge.owners_of_credential(_line(credential), settings.owner)
    left = False
    for owner in filter(None, owners):  # SPEC §5: the legacy owner's jobs are the same customer's
        report = await purge.purge_owner(
            store, owner, include_in_flight=args.include_in_flight, batch_size=args.batch_size
        )
        _print(report.to_json() if args.json else _purge_summary(report), as_json=args.json)
        left = left or bool(report.left)
    if left:
        raise _PurgeLeftJobs()


def _purge_summary(report: purge.PurgeReport) -> str:
    states = ", ".join(f"{n} {state}" for state, n in sorted(report.removed_by_state.items()))
    lines = [
        f"owner {report.owner}: removed {report.removed_jobs} jobs ({states or 'none'}) and "
        f"{report.removed_attempts} attempts in {report.batches} batches"
    ]
    if report.left:
        lines.append(f"left {len(report.left)} jobs (--include-in-flight deletes them too):")
        lines.extend(f"  {job.id}  {job.state}  {job.reason}" for job in report.left)
    return "\n".join(lines)


class _PurgeLeftJobs(Exception):
    """A purge that left jobs: exit status 1, its report printed already."""


async def _list(args: argparse.Namespace, store: Operators, _settings: Settings) -> None:
    state = JobState(args.state) if args.state else None
    jobs = await service.list_jobs(store, state=state, owner=args.owner, limit=args.limit)
    views = [job_to_json(job) for job in jobs]
    _print(views if args.json else jobs_table(views), as_json=args.json)


async def _show(args: argparse.Namespace, store: Operators, _settings: Settings) -> None:
    await _print_job(args, store, await service.find_job(store, args.job_id))


async def _find(args: argparse.Namespace, store: Operators, settings: Settings) -> None:
    owners: tuple[str, str | None] = (args.owner, None)
    if args.sender is not None:
        owners = (service.sender_owner(args.sender), None)
    elif args.owner is None:
        credential = _body(args.credential_file).decode("utf-8", "surrogateescape")
        owners = purge.owners_of_credential(_line(credential), settings.owner)
    job = await service.find_by_key(store, args.key, owners)
    await _print_job(args, store, job)


async def _print_job(args: argparse.Namespace, store: Operators, job: Job) -> None:
    late = None
    if args.include_response:
        job, late = service.shown(store, job), await service.late_responses(store, job)
    view = job_to_json(job, include_response=args.include_response, late=late)
    _print(view if args.json else job_details(view), as_json=args.json)


async def _resolve(args: argparse.Namespace, store: Operators, settings: Settings) -> None:
    resolution = _resolution(args, ResponseRules.from_settings(settings))
    job = await service.resolve_job(store, args.job_id, resolution, default_ttl=settings.ttl)
    status = f" (status {job.response.status})" if job.response else ""
    summary = f"job {job.id}: resolved as {job.state.value}{status}; now at version {job.version}"
    _print(job_to_json(job) if args.json else summary, as_json=args.json)


async def _delete(args: argparse.Namespace, store: Operators, _settings: Settings) -> None:
    job = await service.delete_job(
        store, args.job_id, force=args.force, version=args.expect_version
    )
    print(f"job {job.id}: deleted (it was {job.state.value})")


async def _reseal(args: argparse.Namespace, stack: StoreStack, _settings: Settings) -> None:
    sealing = stack.layer(SealingStore)
    if sealing is None:
        raise InvalidRequest("store reseal needs encryption.keys (the key ring) to be set")
    report = await reseal_store(
        stack.record, sealing.codec, batch_size=args.batch_size, pause=max(0.0, args.pause)
    )
    print("\n".join(report_lines(report)))
    left = (report.responses, report.late)
    if any(counts.left for counts in left):
        raise ResealIncomplete()


def _resolution(args: argparse.Namespace, rules: ResponseRules) -> Resolution:
    if args.as_ == "released":
        if args.status is not None or args.header or args.body_file is not None:
            raise InvalidRequest("--as released takes no --status, --header or --body-file")
        return released(args.expect_version)
    if args.from_attempt is not None:
        if args.status is not None or args.header or args.body_file is not None:
            raise InvalidRequest("--from-attempt takes no --status, --header or --body-file")
        return from_attempt(args.from_attempt, args.expect_version)
    if args.status is None:
        raise InvalidRequest("--as completed needs --status N (or --from-attempt N)")
    headers = [parse_header_line(line) for line in args.header]
    return completed(args.status, headers, _body(args.body_file), rules, args.expect_version)


def _body(path: str | None) -> bytes:
    if path is None:
        return b""
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"--body-file: cannot read {path}: {exc.strerror}") from exc


def _on_record(
    action: Action,
) -> Callable[[argparse.Namespace, StoreStack, Settings], Awaitable[None]]:
    async def on_record(args: argparse.Namespace, stack: StoreStack, settings: Settings) -> None:
        await action(args, stack.record, settings)

    return on_record


def _runner(
    action: Callable[[argparse.Namespace, StoreStack, Settings], Awaitable[None]],
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        settings = _settings(args)
        try:
            asyncio.run(_with_store(settings, args, action))
        except InvalidRequest as exc:
            print(f"idemproxy: {exc.detail}", file=sys.stderr)
            return EXIT_USAGE
        except StoreUnreachable as exc:
            print(f"idemproxy: {exc.reason}", file=sys.stderr)
            return EXIT_FAILED
        except StoreUnavailable as exc:
            cause = f": {exc.__cause__}" if exc.__cause__ else ""
            print(f"idemproxy: store unavailable{cause}", file=sys.stderr)
            return EXIT_FAILED
        except ResealIncomplete:
            return EXIT_FAILED
        except OperatorError as exc:  # not found, or the change lost: say which
            print(f"idemproxy: {exc.detail}", file=sys.stderr)
            return EXIT_FAILED
        except (_PurgeLeftJobs, _InvalidationsLeft):
            return EXIT_FAILED
        return EXIT_OK

    return run


async def _with_store(
    settings: Settings,
    args: argparse.Namespace,
    action: Callable[[argparse.Namespace, StoreStack, Settings], Awaitable[None]],
) -> None:
    record = command_store(settings.store, max_connections=2)
    stack = StoreStack.of(wrap_with_seal(wrap_with_cache(record, settings), settings))
    await stack.open()
    unsent: list[str] = []
    try:
        await action(args, stack, settings)
    finally:
        unsent = await _invalidations_left(stack)
        await stack.close()
        if unsent:
            print(f"idemproxy: {unsent_remedy(unsent, settings.redis.url or '')}", file=sys.stderr)
    if unsent:
        raise _InvalidationsLeft()


async def _invalidations_left(stack: StoreStack) -> list[str]:
    redis = redis_layer(stack)
    return await invalidations_left(None if redis is None else redis.cache)


class _InvalidationsLeft(Exception):
    """Redis did not take every invalidation (printed already)."""


def _settings(args: argparse.Namespace) -> Settings:
    """--store > IDEMPROXY_STORE > the config file, as for `migrate`."""
    if args.config is not None and not Path(args.config).is_file():
        raise ConfigError(f"config: no such file: {args.config}")
    redis = None if args.redis is None else {"url": args.redis}
    settings = load_settings(args.config, store=args.store, redis=redis, upstream=_NO_UPSTREAM)
    if settings.store.startswith("sqlite://"):
        path = sqlite_path(settings.store)
        # Opening a missing file would create an empty database and hide a typo.
        if path != ":memory:" and not Path(path).is_file():
            raise ConfigError(f"store: no SQLite database at {Path(path).resolve()}")
    return settings


def _line(text: str) -> str:
    """A credential file's one line, without its line end (`\n`, or `\r\n` from Windows) and
    the byte order mark an editor may put before it (no header value starts with one)."""
    return text.removeprefix("\ufeff").removesuffix("\n").removesuffix("\r")


def _print(data: Any, *, as_json: bool) -> None:
    print(json.dumps(data, indent=2) if as_json else data)


def _owner(value: str) -> str:
    """An owner as the store keeps it (`service.owner_filter`)."""
    try:
        return service.owner_filter(value)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _limit(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= _MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {_MAX_LIMIT}")
    return int(value)
