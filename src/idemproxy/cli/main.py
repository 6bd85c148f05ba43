"""Command line: argument parsing → Settings → run. Nothing else lives here."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from idemproxy import __version__
from idemproxy.cli.help import describe_defaults, describe_setting_flags
from idemproxy.config.settings import Settings, load_settings, parse_listen
from idemproxy.config.units import DURATION_HELP, SIZE_HELP
from idemproxy.errors import ConfigError, IdemproxyError, NotDistributable, StoreUnreachable

# Flag name → settings field (dotted for nested settings).
_SERVE_FLAGS = {
    "listen": "listen",
    "upstream": "upstream",
    "store": "store",
    "redis": "redis.url",
    "profile": "profile",
    "methods": "methods",
    "owner": "owner.strategy",
    "jwt_key": "owner.jwt.key",
    "jwt_jwks_uri": "owner.jwt.jwks_uri",
    "jwt_algorithms": "owner.jwt.algorithms",
    "jwt_audience": "owner.jwt.audience",
    "jwt_claim": "owner.jwt.claim",
    "ttl": "ttl",
    "lease": "lease",
    "upstream_timeout": "upstream_timeout",
    "max_wait": "max_wait",
    "max_request_body": "max_request_body",
    "max_stored_body": "max_stored_body",
    "admin_listen": "admin.listen",
    "fallbacks": "fallbacks",
    "hedge_after": "hedge_after",
    "forward_host": "forward_host",
    "log_level": "log_level",
    "log_format": "log_format",
    "workers": "server.workers",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(_command_of(argv)).parse_args(argv)
    args.argv = argv  # a supervisor re-runs the same command line for each worker
    try:
        return int(args.run(args))
    except (ValidationError, IdemproxyError) as exc:
        # Lines logged before the failure may still be queued for the log writer's thread
        # (observe/logs.py): they go first, and the error is the last word on stderr.
        for handler in logging.getLogger().handlers:
            handler.flush()
        return _report(exc)
    except KeyboardInterrupt:
        return 130


def _report(exc: ValidationError | IdemproxyError) -> int:
    """The one line (one per invalid field) that ends a failed command, and its status."""
    if isinstance(exc, ValidationError):
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"]) or "settings"
            print(f"idemproxy: invalid configuration: {field}: {error['msg']}", file=sys.stderr)
        return 2
    if isinstance(exc, ConfigError):
        print(f"idemproxy: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, StoreUnreachable):  # not the line meant for HTTP clients
        print(f"idemproxy: {exc.reason}", file=sys.stderr)
        return 1
    print(f"idemproxy: {exc}", file=sys.stderr)
    return 1


def _command_of(argv: Sequence[str]) -> str | None:
    """The command a command line runs: its first argument that is no option (the top level
    has only `--version` and `--help`); None without one, or when the top level's own help
    comes first (`idemproxy -h jobs` lists every command)."""
    for arg in argv:
        if arg in ("-h", "--help"):
            return None
        if not arg.startswith("-"):
            return arg
    return None


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's flags; with `command` given, the batch runner's and the contract
    check's only when they are that command (listed by name otherwise): their imports (an
    HTTP client, the runner, its progress display) would cost every other command about a
    fifth of a second to start."""
    parser = argparse.ArgumentParser(prog="idemproxy", description="Make any HTTP API idempotent.")
    parser.add_argument("--version", action="version", version=f"idemproxy {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    _add_serve(commands)

    migrate = commands.add_parser("migrate", help="apply the store's SQL migrations")
    _config_flag(migrate)
    migrate.add_argument("--store", metavar="DSN", help="the store to migrate")
    migrate.add_argument(
        "--distribute",
        action="store_true",
        help="then distribute both tables by owner, co-located (a Citus coordinator only;"
        " idempotent)",
    )
    describe_setting_flags(migrate, {"store": "store"})
    migrate.set_defaults(run=_migrate)

    demo = commands.add_parser("demo", help="show a double click becoming one execution")
    demo.add_argument(
        "--webhooks",
        action="store_true",
        help="instead: a webhook receiver under Stripe- and Standard-Webhooks-style redelivery"
        " storms (docs/webhooks.md)",
    )
    demo.set_defaults(run=_demo)

    if command in (None, "batch"):
        from idemproxy.batch.cli import add_batch_commands

        add_batch_commands(commands)
    else:
        commands.add_parser("batch")
    if command in (None, "contract"):
        from idemproxy.cli.contract import add_contract_commands

        add_contract_commands(commands)
    else:
        commands.add_parser("contract")

    from idemproxy.cli.ops import add_jobs_commands, add_store_commands

    add_jobs_commands(commands)
    add_store_commands(commands)
    describe_defaults(parser)
    return parser


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`idemproxy serve` and its flags (each described in --help with its variable)."""
    serve = commands.add_parser("serve", help="run the proxy")
    _config_flag(serve)
    serve.add_argument("--listen", metavar="HOST:PORT", help="the proxy's address")
    serve.add_argument("--upstream", metavar="URL", help="the backend for the catch-all route")
    serve.add_argument(
        "--fallback",
        action="append",
        metavar="URL",
        dest="fallbacks",
        help="a fallback upstream for --upstream (repeatable, tried in order)",
    )
    serve.add_argument(
        "--hedge-after",
        metavar="DURATION",
        help="hedge on the next upstream after this long (side-effect-free upstreams only)",
    )
    serve.add_argument(
        "--forward-host",
        metavar="MODE",
        help="the Host --upstream receives: auto, client, upstream or a fixed host[:port]",
    )
    serve.add_argument(
        "--store", metavar="DSN", help="where jobs live: sqlite:///PATH or postgresql://…"
    )
    serve.add_argument(
        "--redis", metavar="URL", help="redis://HOST:PORT: replay cache and wake-ups (optional)"
    )
    serve.add_argument(
        "--profile", choices=["default", "ietf"], help="the header names and problem types"
    )
    serve.add_argument("--methods", metavar="LIST", help="governed methods")
    serve.add_argument(
        "--require-key",
        action="store_const",
        const=True,
        default=None,
        help="refuse governed requests without an Idempotency-Key",
    )
    serve.add_argument(
        "--owner", metavar="STRATEGY", help="authorization | header:NAME | jwt | none"
    )
    serve.add_argument(
        "--jwt-key", metavar="FILE|env:NAME", help="PEM or JWKS file, or env:NAME (HMAC secret)"
    )
    serve.add_argument(
        "--jwt-jwks-uri",
        metavar="URL",
        help="or the https:// JWKS URL of an identity provider, fetched and refreshed",
    )
    serve.add_argument("--jwt-algorithms", metavar="LIST", help="e.g. RS256,ES256 (required)")
    serve.add_argument("--jwt-audience", metavar="LIST", help="accepted aud values (required)")
    serve.add_argument("--jwt-claim", metavar="CLAIM", help="the owner claim")
    serve.add_argument("--ttl", metavar="DURATION", help=f"job lifetime: {DURATION_HELP}")
    serve.add_argument(
        "--lease", metavar="DURATION", help="how long an attempt is owned without a renewal"
    )
    serve.add_argument("--upstream-timeout", metavar="DURATION", help="one attempt's deadline")
    serve.add_argument(
        "--max-wait",
        metavar="DURATION",
        help="longest a duplicate waits for the first, default --upstream-timeout + 5s",
    )
    serve.add_argument(
        "--max-request-body", metavar="SIZE", help=f"largest request body: {SIZE_HELP}"
    )
    serve.add_argument(
        "--max-stored-body", metavar="SIZE", help="largest response body stored for replay"
    )
    serve.add_argument("--admin-listen", metavar="HOST:PORT", help="the admin listener's address")
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="proxy processes sharing --listen (PostgreSQL store only)",
    )
    serve.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not apply migrations at start (env IDEMPROXY_MIGRATE=false)",
    )
    serve.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="least severe logged"
    )
    serve.add_argument(
        "--log-format", choices=["plain", "json"], help="one line of text or of JSON per event"
    )
    # Internal: set by the supervisor for each of its workers (workers/role.py).
    serve.add_argument("--worker-role", metavar="JSON", help=argparse.SUPPRESS)
    describe_setting_flags(serve, {**_SERVE_FLAGS, "require_key": "require_key"})
    serve.set_defaults(run=_serve)


def _config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        default=os.environ.get("IDEMPROXY_CONFIG"),
        help="YAML settings file",
    )


def _settings(args: argparse.Namespace, flags: dict[str, str], **extra: Any) -> Settings:
    overrides: dict[str, Any] = dict(extra)
    for flag, field in flags.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        target = overrides
        *parents, leaf = field.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    if getattr(args, "require_key", None):
        overrides["require_key"] = True
    if getattr(args, "no_migrate", False):
        overrides["migrate"] = False
    if args.config is not None and not Path(args.config).is_file():
        raise ConfigError(f"config: no such file: {args.config}")
    return load_settings(args.config, **overrides)


def _serve(args: argparse.Namespace) -> int:
    from idemproxy.cli.serve import serve
    from idemproxy.proxy.idp.policy import build_owner_policy
    from idemproxy.proxy.upstream.dial import Dialing

    settings = _settings(args, _SERVE_FLAGS)
    parse_listen(settings.listen)
    # With JWT owners this loads the keys: a bad one stops the start before the store is opened.
    owner = build_owner_policy(settings.owner)
    Dialing.check(settings)  # so do TLS files that do not load and an unusable HTTPS_PROXY
    if args.worker_role is not None:
        from idemproxy.workers.role import WorkerRole

        serve(settings, owner, WorkerRole.from_arg(args.worker_role))
        return 0
    if settings.server.workers > 1:
        from idemproxy.workers.supervisor import supervise

        return supervise(settings, args.argv)
    from idemproxy.workers.listen import probe

    probe(*parse_listen(settings.listen))  # a taken port fails before the store is touched
    serve(settings, owner)
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from idemproxy.store.factory import command_store
    from idemproxy.store.postgres.citus import require_citus
    from idemproxy.store.postgres.store import PostgresStore

    # Only the store matters here: an upstream is not required to migrate.
    settings = _settings(args, {"store": "store"}, upstream="http://migrate.invalid")

    async def run() -> tuple[list[str], list[str] | None]:
        store = command_store(settings.store)
        if args.distribute and not isinstance(store, PostgresStore):
            raise NotDistributable(
                "store: --distribute needs a PostgreSQL store on a Citus coordinator"
            )
        await store.open()
        try:
            if isinstance(store, PostgresStore) and args.distribute:
                require_citus(store.citus)  # before migrating: a refusal leaves nothing done
            applied = await store.migrate()
            if args.distribute and isinstance(store, PostgresStore):
                return applied, await store.distribute()
            return applied, None
        finally:
            await store.close()

    applied, distributed = asyncio.run(run())
    print(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied else ""))
    if distributed is not None:
        print(
            f"distributed {len(distributed)} table(s) by owner"
            + (f": {', '.join(distributed)}" if distributed else " (both already were)")
        )
    return 0


def _demo(args: argparse.Namespace) -> int:
    # The demo tells what happens to each request itself; the proxy's warnings for an
    # operator (the upstream timeout scenario 4 makes on purpose) would break into its lines.
    logging.basicConfig(level=logging.ERROR)
    if args.webhooks:
        from idemproxy.cli.demo_webhooks import run_webhooks_demo

        return asyncio.run(run_webhooks_demo())
    from idemproxy.cli.demo import run_demo

    return asyncio.run(run_demo())
