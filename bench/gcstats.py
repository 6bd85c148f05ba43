"""`idemproxy serve` with the cyclic garbage collector's work recorded (and optionally frozen).

An experiment, not part of bench/run: it measures what bench/findings.md says about the garbage
collector. Runs the proxy exactly as `python -m idemproxy …` would, after registering a
`gc.callbacks` hook that adds up collections and their time per generation and writes them, as
JSON, to GCSTATS (a file path) every second. With FREEZE=1 it calls `gc.freeze()` once
everything is imported, the change bench/findings.md proposes for start-up. GC_THRESHOLD=a,b,c
sets the collector's thresholds (`gc.set_threshold`) first.

    GCSTATS=/tmp/gc.json FREEZE=1 .venv/bin/python bench/gcstats.py serve --upstream … --store …

Read the file before and after a wrk run: collections and seconds per generation, the longest
pause, and per request (divide by wrk's request count).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp  # noqa: F401  (imported before the freeze, as the proxy does at start-up)
import asyncpg  # noqa: F401

import idemproxy.cli.serve
import idemproxy.proxy.app  # noqa: F401
from idemproxy.cli.main import main as idemproxy_main

STATS: dict[int, dict[str, float]] = {
    generation: {"collections": 0, "seconds": 0.0, "longest": 0.0} for generation in range(3)
}
_started = [0.0]


def _callback(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _started[0]
    stats = STATS[int(info["generation"])]
    stats["collections"] += 1
    stats["seconds"] += took
    stats["longest"] = max(stats["longest"], took)


def _dump(path: Path) -> None:
    while True:
        time.sleep(1.0)
        path.write_text(json.dumps(STATS))


def main() -> int:
    if os.environ.get("FREEZE") == "1":
        gc.collect()
        gc.freeze()
    if os.environ.get("GC_THRESHOLD"):
        gc.set_threshold(*(int(part) for part in os.environ["GC_THRESHOLD"].split(",")))
    gc.callbacks.append(_callback)
    threading.Thread(target=_dump, args=(Path(os.environ["GCSTATS"]),), daemon=True).start()
    return idemproxy_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
