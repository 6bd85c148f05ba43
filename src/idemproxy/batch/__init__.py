"""The checkpointed batch runner (SPEC §14): `idemproxy batch` and its Python API.

import asyncio
from idemproxy.batch import BatchOptions, run_batch

summary = asyncio.run(
    run_batch("items.jsonl", "results.jsonl", BatchOptions(target="http://127.0.0.1:8080"))
)

input.py       the input file: items, validated with line numbers
keys.py        each item's request hash and deterministic Idempotency-Key
records.py     one self-describing result line
checkpoint.py  the append-only, fsynced results file; torn-line repair
outcome.py     pure: what an answer means, how long to back off
client.py      sending one item with retries under the same key (aiohttp)
plan.py        pure: what a run sends, given what the results already hold
usage.py       pure: the tokens an answer reports, and a request's estimate
prices.py      the price table               ledger.py   tokens (and money) over result lines
budget.py      pure: the budget stop         ratelimit.py  --rpm/--tpm buckets, 429 pauses
admission.py   which item starts next, and when each attempt may go
runner.py      `run_batch`
progress.py    live bar / plain lines        status.py   `batch status`
export.py      `batch export --failed`
stop.py        the two-step Ctrl-C           cli.py      `idemproxy batch …`
"""

from __future__ import annotations

from idemproxy.batch.errors import (
    BatchError,
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointUnwritable,
    InvalidInput,
    KeyHeaderChanged,
    KeyPrefixChanged,
)
from idemproxy.batch.input import Item
from idemproxy.batch.progress import NullReporter, PlainReporter, Reporter, RichReporter
from idemproxy.batch.records import Outcome, ResultRecord
from idemproxy.batch.runner import BatchOptions, run_batch
from idemproxy.batch.status import BatchStatus, batch_status
from idemproxy.batch.stop import Stop
from idemproxy.batch.summary import BatchSummary

__all__ = [
    "BatchError",
    "BatchOptions",
    "BatchStatus",
    "BatchSummary",
    "CheckpointCorrupt",
    "CheckpointLocked",
    "CheckpointUnwritable",
    "InvalidInput",
    "Item",
    "KeyHeaderChanged",
    "KeyPrefixChanged",
    "NullReporter",
    "Outcome",
    "PlainReporter",
    "Reporter",
    "ResultRecord",
    "RichReporter",
    "Stop",
    "batch_status",
    "run_batch",
]
