"""`idemproxy batch run|status|export`: flags → BatchOptions → `run_batch` (SPEC §13, §14).

Exit status of `run`: 0 when every item has a `done` result, 1 when some do not (failed,
unknown, omitted, changed), 2 when the run could not start or go on (bad flags, invalid input, a
results file that is corrupt, locked, unwritable or written under another key prefix or key
header), 3 when the budget (`--max-tokens`, `--max-cost`) stopped it before every item was
sent, 130 when it was stopped with Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from contextlib import suppress
from decimal import Decimal, InvalidOperation
from pathlib import Path

from idemproxy.batch.constants import (
    DEFAULT_CONCURRENCY,
    DEFAULT_KEY_PREFIX,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_SECONDS,
)
from idemproxy.batch.errors import BatchError
from idemproxy.batch.export import export_failed
from idemproxy.batch.prices import PriceTable, load_prices
from idemproxy.batch.progress import PlainReporter, Reporter, RichReporter
from idemproxy.batch.runner import BatchOptions, run_batch
from idemproxy.batch.status import batch_status
from idemproxy.batch.stop import Stop
from idemproxy.batch.summary import BatchSummary
from idemproxy.batch.usage import BUILT_IN_POINTERS, UsagePointers, check_pointer
from idemproxy.constants import DEFAULT_KEY_HEADER

_EXIT_INCOMPLETE, _EXIT_CANNOT_START, _EXIT_BUDGET, _EXIT_STOPPED = 1, 2, 3, 130


def add_batch_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `batch run` and `batch status` on the top-level subparsers."""
    batch = commands.add_parser("batch", help="send a JSONL file of requests, checkpointed")
    actions = batch.add_subparsers(required=True, metavar="ACTION")
    _add_run(actions.add_parser("run", help="send every item the results do not answer yet"))
    _add_status(actions.add_parser("status", help="how far a run got; sends nothing"))
    _add_export(
        actions.add_parser("export", help="the input lines of items that need another look")
    )


def _add_run(run: argparse.ArgumentParser) -> None:
    run.add_argument("input", type=Path, metavar="INPUT.jsonl")
    run.add_argument("--target", required=True, metavar="URL", help="the proxy's base URL")
    run.add_argument(
        "--output",
        required=True,
        type=Path,
        metavar="RESULTS.jsonl",
        help="one result line per item, appended; a rerun skips the items already in it",
    )
    run.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        metavar="N",
        help="items in flight at once",
    )
    run.add_argument(
        "--key-prefix",
        default=DEFAULT_KEY_PREFIX,
        metavar="PREFIX",
        help="each item's key is derived from it and the item's id",
    )
    run.add_argument(
        "--key-header", default=DEFAULT_KEY_HEADER, metavar="NAME", help="the key's header"
    )
    run.add_argument(
        "--retries",
        type=int,
        default=DEFAULT_RETRIES,
        metavar="N",
        help="tries after the first for a transient failure, with backoff, same key",
    )
    run.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, metavar="S", help="per attempt"
    )
    run.add_argument(
        "-H", "--header", action="append", default=[], metavar="'NAME: VALUE'",
        help="sent with every item, never written (repeatable)",
    )  # fmt: skip
    run.add_argument(
        "--header-env", action="append", default=[], metavar="NAME=VAR",
        help="header NAME from environment variable VAR, e.g. Authorization=API_AUTH",
    )  # fmt: skip
    for flag, text in _SWITCHES.items():
        run.add_argument(flag, action="store_true", help=text)
    run.add_argument("--no-progress", action="store_true", help="plain lines, no live bar")
    _add_metering(run)
    run.set_defaults(run=_run)


def _add_metering(run: argparse.ArgumentParser) -> None:
    run.add_argument("--prices", type=Path, metavar="FILE", help="price table (YAML or JSON)")
    run.add_argument(
        "--usage-pointers", metavar="INPUT,OUTPUT",
        help="JSON pointers to the answer's token counts, e.g. /meta/tokens/in,/meta/tokens/out",
    )  # fmt: skip
    run.add_argument("--max-tokens", type=int, metavar="N", help="budget stop, in tokens")
    run.add_argument("--max-cost", type=_decimal, metavar="X", help="budget stop (--prices)")
    run.add_argument(
        "--assume-max-output", type=int, metavar="N",
        help="output tokens counted for an item whose request sets no max_tokens",
    )  # fmt: skip
    run.add_argument("--rpm", type=float, metavar="N", help="requests per minute, all workers")
    run.add_argument("--tpm", type=float, metavar="N", help="tokens per minute, all workers")


def _decimal(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value.is_finite():
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


_SWITCHES = {
    "--skip-invalid": "leave out invalid input lines instead of refusing to start",
    "--retry-failed": "send failed items again (same key)",
    "--retry-unknown": "ask again for items whose outcome was unknown (after resolving them)",
    "--rerun-changed": "send items edited since their result was written, as new intents",
    "--retry-omitted": "ask again for items the proxy answered without their body (same key)",
}


def _add_status(status: argparse.ArgumentParser) -> None:
    status.add_argument("results", type=Path, metavar="RESULTS.jsonl")
    status.add_argument(
        "--input",
        type=Path,
        metavar="INPUT.jsonl",
        help="the input file: also count pending and changed items",
    )
    status.add_argument(
        "--key-header", default=DEFAULT_KEY_HEADER, metavar="NAME", help="the key's header"
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--prices", type=Path, metavar="FILE", help="price table (YAML or JSON)")
    status.set_defaults(run=_status)


def _add_export(export: argparse.ArgumentParser) -> None:
    export.add_argument("results", type=Path, metavar="RESULTS.jsonl")
    export.add_argument(
        "--input", required=True, type=Path, metavar="INPUT.jsonl",
        help="the input file the results answer: its lines are written out as they are",
    )  # fmt: skip
    export.add_argument(
        "--failed", required=True, action="store_true",
        help="items whose result is failed or unknown (omitted ones are left out)",
    )  # fmt: skip
    export.add_argument(
        "--key-header", default=DEFAULT_KEY_HEADER, metavar="NAME", help="the key's header"
    )
    export.set_defaults(run=_export)


def _run(args: argparse.Namespace) -> int:
    try:
        options = _options(args, os.environ)
        reporter = _reporter(args.no_progress)
        summary = asyncio.run(_run_until_stopped(args.input, args.output, options, reporter))
    except BatchError as exc:
        print(f"idemproxy batch: {exc}", file=sys.stderr)
        return _EXIT_CANNOT_START
    print(summary.describe(), file=sys.stderr)
    return _exit_status(summary)


def _exit_status(summary: BatchSummary) -> int:
    if summary.stopped:
        return _EXIT_STOPPED
    if summary.budget_stop is not None and summary.interrupted:
        return _EXIT_BUDGET
    return 0 if summary.complete else _EXIT_INCOMPLETE


async def _run_until_stopped(
    source: Path, output: Path, options: BatchOptions, reporter: Reporter
) -> BatchSummary:
    stop = Stop()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.request()
        if stop.abandoned.is_set():
            reporter.note("abandoning the items in flight; a rerun resumes them")
        else:
            reporter.note("stopping: finishing the items in flight (Ctrl-C again to abandon them)")

    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        with suppress(NotImplementedError):  # pragma: no cover - Windows
            loop.add_signal_handler(signum, on_signal)
    try:
        return await run_batch(source, output, options, reporter=reporter, stop=stop)
    finally:
        for signum in signals:
            with suppress(NotImplementedError):  # pragma: no cover - Windows
                loop.remove_signal_handler(signum)


def _options(args: argparse.Namespace, environ: dict[str, str] | os._Environ[str]) -> BatchOptions:
    return BatchOptions(
        target=args.target,
        concurrency=args.concurrency,
        key_prefix=args.key_prefix,
        key_header=args.key_header,
        headers=_headers(args.header, args.header_env, environ),
        retries=args.retries,
        timeout=args.timeout,
        skip_invalid=args.skip_invalid,
        retry_failed=args.retry_failed,
        retry_unknown=args.retry_unknown,
        rerun_changed=args.rerun_changed,
        retry_omitted=args.retry_omitted,
        usage_pointers=_pointers(args.usage_pointers),
        prices=_prices(args.prices),
        max_tokens=args.max_tokens,
        max_cost=args.max_cost,
        assume_max_output=args.assume_max_output,
        rpm=args.rpm,
        tpm=args.tpm,
    )


def _pointers(spec: str | None) -> tuple[UsagePointers, ...]:
    """The given pointers first, then the built-in OpenAI and Anthropic shapes."""
    if spec is None:
        return BUILT_IN_POINTERS
    given, sep, output = spec.partition(",")
    try:
        if not sep or not given or not output:
            raise ValueError("expected INPUT,OUTPUT, e.g. /meta/tokens/in,/meta/tokens/out")
        pointers = UsagePointers(check_pointer(given), check_pointer(output))
    except ValueError as exc:
        raise BatchError(f"--usage-pointers: {exc}") from None
    return (pointers, *BUILT_IN_POINTERS)


def _prices(path: Path | None) -> PriceTable | None:
    return None if path is None else load_prices(path)


def _headers(
    flags: Sequence[str], from_env: Sequence[str], environ: dict[str, str] | os._Environ[str]
) -> dict[str, str]:
    headers: dict[str, str] = {}
    for flag in flags:
        name, sep, value = flag.partition(":")
        if not sep or not name.strip():
            raise BatchError(f"--header must be 'Name: value', not {flag!r}")
        headers[name.strip()] = value.strip()
    for spec in from_env:
        name, sep, variable = spec.partition("=")
        if not sep or not name.strip() or not variable:
            raise BatchError(f"--header-env must be NAME=VARIABLE, not {spec!r}")
        if variable not in environ:
            raise BatchError(f"--header-env {spec}: environment variable {variable} is not set")
        headers[name.strip()] = environ[variable]
    return headers


def _reporter(no_progress: bool) -> Reporter:
    if no_progress or not sys.stderr.isatty():
        return PlainReporter()
    return RichReporter()


def _status(args: argparse.Namespace) -> int:
    try:
        prices = _prices(args.prices)
        status = batch_status(args.results, args.input, key_header=args.key_header, prices=prices)
    except BatchError as exc:
        print(f"idemproxy batch: {exc}", file=sys.stderr)
        return _EXIT_CANNOT_START
    print(json.dumps(status.to_json(), indent=2) if args.json else status.describe())
    return 0


def _export(args: argparse.Namespace) -> int:
    try:
        export = export_failed(args.results, args.input, key_header=args.key_header)
    except BatchError as exc:
        print(f"idemproxy batch: {exc}", file=sys.stderr)
        return _EXIT_CANNOT_START
    sys.stdout.buffer.write(b"".join(export.lines))
    sys.stdout.flush()
    print(export.describe(), file=sys.stderr)
    return 0
