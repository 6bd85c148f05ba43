"""The proxy's memory (memory.py): VmHWM with held duplicates of one key at a slow backend, and
with many concurrent large bodies, with keys and without."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import memory
from common import Service, running
from runner import Bench, Step


def run(bench: Bench) -> None:
    backend = bench.services["backend"]
    long = ["--upstream-timeout", "120", "--max-wait", "120"]
    hold_env = {"IDEMPROXY_MAX_WAITERS_PER_KEY": str(bench.args.hold + 100)}
    tests: list[tuple[str, dict[str, str], Callable[[Service], Any]]] = [
        (
            "proxy-hold",
            hold_env,
            lambda proxy: memory.hold_test(
                proxy.url,
                backend.url,
                proxy.admin_url or "",
                proxy.pid,
                f"{bench.nonce}-hold",
                bench.args.hold,
            ),
        ),
        (
            "proxy-bodies",
            {},
            lambda proxy: memory.bodies_test(
                proxy.url, backend.url, proxy.pid, f"{bench.nonce}-body", 100, 10 * memory.MIB
            ),
        ),
        (
            "proxy-bodies-passthrough",
            {},
            lambda proxy: memory.bodies_test(
                proxy.url, backend.url, proxy.pid, None, 100, 10 * memory.MIB
            ),
        ),
    ]
    for name, env, test in tests:
        print(f"bench: memory: {name} …", flush=True)
        with running(bench.start_proxy(name, bench.pg_store(), *long, env=env)) as proxy:
            time.sleep(0.5)
            result: memory.MemoryResult = asyncio.run(test(proxy))
        bench.memory_results.append(result)
        print(
            f"bench: memory: {result.title}: VmHWM {result.hwm_mb:.0f} MB, peak VmRSS "
            f"{result.rss_peak_mb:.0f} MB, statuses {result.statuses}",
            flush=True,
        )


STEP = Step("memory", (), run, also=("memory",))
