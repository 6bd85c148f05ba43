"""Test-only crash points (issue: crash tests with real SIGKILLs).

`IDEMPROXY_TEST_FAILPOINT=<name>` makes the process kill itself with SIGKILL at that point of
the first governed request that reaches it. Never set it in production.
"""

from __future__ import annotations

import asyncio
import os
import signal
import types
from collections.abc import Sequence

import aiohttp

ENV = "IDEMPROXY_TEST_FAILPOINT"
# After the claim committed; after the request was sent upstream; after the response arrived
# but before it was stored; after it was stored but before the client got it.
POINTS = frozenset({"after_claim", "after_send", "before_store", "after_store"})


class Failpoints:
    def __init__(self, armed: str | None) -> None:
        if armed is not None and armed not in POINTS:
            raise ValueError(f"{ENV}: unknown failpoint {armed!r}")
        self.armed = armed

    @classmethod
    def from_env(cls) -> Failpoints:
        return cls(os.environ.get(ENV) or None)

    def hit(self, name: str) -> None:
        if name == self.armed:
            os.kill(os.getpid(), signal.SIGKILL)

    def trace_configs(self) -> Sequence[aiohttp.TraceConfig]:
        """`after_send` fires from aiohttp's client once a body chunk is on the wire."""
        if self.armed != "after_send":
            return ()
        config = aiohttp.TraceConfig()

        async def on_chunk_sent(
            _session: aiohttp.ClientSession,
            _context: types.SimpleNamespace,
            _params: aiohttp.TraceRequestChunkSentParams,
        ) -> None:
            # aiohttp calls this *before* it writes the chunk (and the headers it buffered):
            # dying here would mean nothing ever reached the upstream. Die on the next turn of
            # the loop instead, once the request bytes were handed to the kernel.
            asyncio.get_running_loop().call_soon(self.hit, "after_send")

        config.on_request_chunk_sent.append(on_chunk_sent)
        return (config,)
