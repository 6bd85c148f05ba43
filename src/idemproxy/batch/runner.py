"""`run_batch`: the checkpointed batch runner that `idemproxy batch run` is built on (SPEC §14).

    summary = await run_batch("in.jsonl", "out.jsonl", BatchOptions(target="http://127.0.0.1:8080"))

The whole input is validated before anything is sent; the results file is locked, its torn last
line (if any) repaired, and the ids it already answers are skipped. Up to `concurrency` items are
in flight at once; each result is appended and fsynced as soon as it arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from os import PathLike
from pathlib import Path
from typing import Any

import aiohttp
from yarl import URL

from idemproxy import __version__
from idemproxy.batch.admission import Admission, Admitted, LimiterGate
from idemproxy.batch.budget import Budget, Limits
from idemproxy.batch.checkpoint import Checkpoint, CheckpointWriter, RunKeys
from idemproxy.batch.client import (
    AttemptGate,
    Request,
    RetryPolicy,
    build_request,
    failed_record,
    send,
)
from idemproxy.batch.constants import (
    DEFAULT_BACKOFF_BASE,
    DEFAULT_BACKOFF_MAX,
    DEFAULT_CONCURRENCY,
    DEFAULT_KEY_PREFIX,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_SECONDS,
    USER_AGENT,
)
from idemproxy.batch.errors import BatchError
from idemproxy.batch.input import InputFile, Item, header_problem, items_from_objects, read_input
from idemproxy.batch.keys import Identity, check_prefix
from idemproxy.batch.ledger import Ledger
from idemproxy.batch.plan import Plan, PlanRules, make_plan
from idemproxy.batch.prices import PriceTable
from idemproxy.batch.progress import NullReporter, Reporter
from idemproxy.batch.ratelimit import RateLimiter
from idemproxy.batch.records import ResultRecord, utc_now
from idemproxy.batch.stop import Stop
from idemproxy.batch.summary import BatchSummary
from idemproxy.batch.usage import (
    BUILT_IN_POINTERS,
    UsagePointers,
    estimate,
    request_model,
    with_usage,
    worst_case,
)
from idemproxy.constants import DEFAULT_KEY_HEADER

Source = str | PathLike[str] | Iterable[Mapping[str, Any]]


@dataclass(frozen=True)
class BatchOptions:
    """Everything a run needs besides its input and output."""

    target: str  # base URL: the proxy, or any API that honours Idempotency-Key
    concurrency: int = DEFAULT_CONCURRENCY
    key_prefix: str = DEFAULT_KEY_PREFIX
    key_header: str = DEFAULT_KEY_HEADER
    headers: Mapping[str, str] = field(default_factory=dict)  # sent, never written
    retries: int = DEFAULT_RETRIES
    timeout: float = DEFAULT_TIMEOUT_SECONDS  # per attempt, whole answer included
    backoff_base: float = DEFAULT_BACKOFF_BASE
    backoff_max: float = DEFAULT_BACKOFF_MAX
    skip_invalid: bool = False
    retry_failed: bool = False
    retry_unknown: bool = False
    rerun_changed: bool = False
    retry_omitted: bool = False
    # Where answers keep their token counts, tried in order (usage.py).
    usage_pointers: tuple[UsagePointers, ...] = BUILT_IN_POINTERS
    prices: PriceTable | None = None  # turns tokens into money (prices.py)
    max_tokens: int | None = None  # the budget stop (budget.py)
    max_cost: Decimal | None = None
    # The output tokens counted for an item whose request sets no max_tokens (usage.py).
    assume_max_output: int | None = None
    rpm: float | None = None  # requests per minute, shared by all workers (ratelimit.py)
    tpm: float | None = None  # tokens per minute, estimated then corrected

    def check(self) -> None:
        url = URL(self.target)
        if url.scheme not in ("http", "https") or not url.host:
            raise BatchError(f"target must be an http(s) URL, not {self.target!r}")
        if self.concurrency < 1 or self.retries < 0 or self.timeout <= 0:
            raise BatchError("concurrency must be ≥ 1, retries ≥ 0 and timeout > 0")
        try:
            check_prefix(self.key_prefix)
        except ValueError as exc:
            raise BatchError(str(exc)) from exc
        self._check_metering()
        # Refused here, before anything is sent, rather than failing every item as it goes out.
        for name, value in {self.key_header: "", **self.headers}.items():
            problem = header_problem(name, value)
            if problem:
                raise BatchError(f"header {name!r} {problem}")

    def _check_metering(self) -> None:
        if any(limit is not None and limit < 0 for limit in (self.max_tokens, self.max_cost)):
            raise BatchError("--max-tokens and --max-cost must be ≥ 0")
        if self.max_cost is not None and self.prices is None:
            raise BatchError("--max-cost needs a price table (--prices FILE)")
        if self.assume_max_output is not None and self.assume_max_output < 0:
            raise BatchError("--assume-max-output must be ≥ 0")
        if any(rate is not None and rate <= 0 for rate in (self.rpm, self.tpm)):
            raise BatchError("--rpm and --tpm must be > 0")

    def limits(self) -> Limits:
        return Limits(self.max_tokens, self.max_cost)

    def rules(self) -> PlanRules:
        return PlanRules(
            self.key_prefix,
            self.retry_failed,
            self.retry_unknown,
            self.rerun_changed,
            self.retry_omitted,
            self.key_header,
        )

    def policy(self) -> RetryPolicy:
        return RetryPolicy(self.retries, self.timeout, self.backoff_base, self.backoff_max)


async def run_batch(
    source: Source,
    output: str | PathLike[str],
    options: BatchOptions,
    *,
    reporter: Reporter | None = None,
    stop: Stop | None = None,
) -> BatchSummary:
    """Send every item of `source` that `output` does not answer yet; return what happened.

    `source` is a JSONL file or an iterable of item objects. Raises `BatchError` (invalid
    input, a results file that is corrupt, locked, or written under another key prefix) before
    anything is sent; network failures never raise: they end up in the results.
    """
    options.check()
    reporter = reporter or NullReporter()
    started = time.monotonic()
    source_items = _load(source, options)
    writer, checkpoint = CheckpointWriter.open(Path(output))
    try:
        plan = make_plan(source_items.items, checkpoint.records, options.rules(), checkpoint.keys)
        _check_worst_cases(plan, options)
        keys = RunKeys(options.key_prefix, options.key_header)
        if plan.send and keys != checkpoint.keys:
            writer.keep_keys(keys)  # durable before the first item goes out
        summary = _initial_summary(source_items, checkpoint, plan, options)
        _announce(reporter, summary, plan)
        _announce_budget(reporter, plan, options)
        reporter.start(plan.skipped + len(plan.send), plan.skipped)
        try:
            await _send_all(plan.send, writer, options, summary, reporter, stop or Stop())
        finally:
            reporter.finish()
    finally:
        writer.close()
    stopped = stop is not None and stop.requested.is_set()
    summary.stopped = stopped or (summary.interrupted > 0 and summary.budget_stop is None)
    summary.elapsed = time.monotonic() - started
    return summary


def _load(source: Source, options: BatchOptions) -> InputFile:
    skip, header = options.skip_invalid, options.key_header
    if isinstance(source, str | PathLike):
        return read_input(Path(source), skip_invalid=skip, key_header=header)
    return items_from_objects(source, skip_invalid=skip, key_header=header)


def _check_worst_cases(plan: Plan, options: BatchOptions) -> None:
    """A budget needs every item's worst case: refused before anything is sent if unknown."""
    if not options.limits().active or options.assume_max_output is not None:
        return
    uncapped = [item for item, _ in plan.send if estimate(item).output_tokens is None]
    if uncapped:
        shown = ", ".join(f"{item.id!r} (line {item.line})" for item in uncapped[:5])
        more = f" and {len(uncapped) - 5} more" if len(uncapped) > 5 else ""
        raise BatchError(
            f"--max-tokens/--max-cost count each item at its worst case, but {len(uncapped)} "
            f"item(s) set no max_tokens, max_completion_tokens or max_output_tokens: {shown}"
            f"{more}; set one, or give --assume-max-output N"
        )


def _initial_summary(
    source: InputFile, checkpoint: Checkpoint, plan: Plan, options: BatchOptions
) -> BatchSummary:
    return BatchSummary(
        total=len(source.items),
        invalid=len(source.invalid),
        skipped=plan.skipped,
        sent=len(plan.send),
        changed=len(plan.changed),
        earlier_failed=plan.kept_failed,
        earlier_unknown=plan.kept_unknown,
        earlier_omitted=plan.kept_omitted,
        torn=checkpoint.torn,
        unterminated=checkpoint.unterminated,
        file_ledger=checkpoint.ledger,
        prices=options.prices,
        limits=options.limits(),
    )


def _announce_budget(reporter: Reporter, plan: Plan, options: BatchOptions) -> None:
    prices = options.prices
    if options.max_cost is None or prices is None:
        return
    unpriced = sorted(
        {str(request_model(item)) for item, _ in plan.send if not prices.price(request_model(item))}
    )
    if unpriced:
        reporter.note(
            f"no price for model(s) {', '.join(unpriced)}: counted against --max-cost at the "
            "table's highest rates"
        )


def _announce(reporter: Reporter, summary: BatchSummary, plan: Plan) -> None:
    if summary.invalid:
        reporter.note(f"left out {summary.invalid} invalid input line(s) (--skip-invalid)")
    if summary.torn is not None:
        reporter.note(
            f"repaired the results file: cut off its torn line {summary.torn.line} "
            f"({summary.torn.size} bytes); that item is sent again under the same key"
        )
    if summary.unterminated is not None:
        reporter.note(
            f"repaired the results file: its last line {summary.unterminated} was a whole result "
            "without its newline; the newline was added"
        )
    if plan.kept_omitted:
        reporter.note(
            f"{plan.kept_omitted} item(s) are 'omitted': executed once, answered without the body "
            "the proxy did not store; not sent again (--retry-omitted asks the proxy again)"
        )
    for item in plan.changed:
        reporter.note(
            f"item {item.id!r} (line {item.line}) changed since its result was written; "
            "left out (--rerun-changed sends it as a new intent)"
        )


async def _send_all(
    work: list[tuple[Item, Identity]],
    writer: CheckpointWriter,
    options: BatchOptions,
    summary: BatchSummary,
    reporter: Reporter,
    stop: Stop,
) -> None:
    run = utc_now()  # names this run in each of its lines
    budget = None
    if options.limits().active:
        budget = Budget(options.limits(), options.prices or PriceTable(), summary.file_ledger)
        budget.assumed_output = options.assume_max_output or 0
    admission = Admission(work, budget, options.assume_max_output)
    limiter = RateLimiter(options.rpm, options.tpm)
    policy = options.policy()

    async def worker(session: aiohttp.ClientSession) -> None:
        sending = _Sending(session, policy, stop, options.usage_pointers, run)
        while (admitted := await admission.next(stop)) is not None:
            item = admitted.item
            try:
                if not await limiter.acquire(admitted.tokens, stop.requested):
                    return  # stopped before it was sent: a rerun sends it
                request = _request(admitted, options, summary.file_ledger)
                gate = LimiterGate(
                    limiter, admitted.tokens, stop, options.usage_pointers, request.sent_before
                )
                record = await _unless_abandoned(_result(sending, request, gate), stop)
                if record is None:
                    return
                writer.append(record)  # durable before it is counted (SPEC §14)
                summary.count(record)
            finally:
                admission.settle(item.id)
            reporter.advance(record)

    try:
        async with _session(options) as session, asyncio.TaskGroup() as group:
            for _ in range(min(options.concurrency, len(admission))):
                group.create_task(worker(session))
    except* BatchError as failed:
        # A worker could not write its result: the others were cancelled (their items are
        # resumed under the same keys); report the cause, not the task group.
        raise failed.exceptions[0] from None
    finally:
        summary.budget_stop = admission.exhausted
        summary.rate_limit_pauses = limiter.pauses


def _request(admitted: Admitted, options: BatchOptions, file_ledger: Ledger) -> Request:
    item, identity = admitted.item, admitted.identity
    request = build_request(item, identity, options.target, options.headers, options.key_header)
    return replace(
        request,
        worst_case=worst_case(item, options.assume_max_output),
        # SPEC §14: an earlier run sent it and had no answer: the answer it gets is this batch's.
        sent_before=identity.key in file_ledger.in_doubt,
    )


@dataclass(frozen=True, slots=True)
class _Sending:
    """What every item of one run is sent with."""

    session: aiohttp.ClientSession
    policy: RetryPolicy
    stop: Stop
    pointers: tuple[UsagePointers, ...]
    run: str  # names this run in each of its lines


async def _result(sending: _Sending, request: Request, gate: AttemptGate) -> ResultRecord:
    """The item's record, one that can be written whatever happened: never raises but cancels."""
    started_at = utc_now()
    try:
        record = await send(
            sending.session, request, sending.policy, stop=sending.stop.requested, gate=gate
        )
        # SPEC §14: an answer that does not say what it used keeps the item's worst case.
        record = with_usage(record, request.item, sending.pointers, request.worst_case)
        record = replace(record, run=sending.run)
        record.to_line()  # proves the line can be written before the worker relies on it
    except Exception as exc:  # one item's failure must never end the whole batch
        return replace(failed_record(request, started_at, exc), run=sending.run)
    return record


def _session(options: BatchOptions) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=options.concurrency),
        headers={"User-Agent": f"{USER_AGENT}/{__version__}"},
    )


async def _unless_abandoned(
    sending: Coroutine[Any, Any, ResultRecord], stop: Stop
) -> ResultRecord | None:
    """The item's result, or None when the stop is escalated while it is in flight."""
    task = asyncio.ensure_future(sending)
    abandon = asyncio.ensure_future(stop.abandoned.wait())
    try:
        await asyncio.wait({task, abandon}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, abandon):
            pending.cancel()
        await asyncio.gather(task, abandon, return_exceptions=True)
    return None if task.cancelled() else task.result()
