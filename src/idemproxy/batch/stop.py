"""A two-step stop, as Ctrl-C works on the command line (SPEC §14: a clean stop).

The first request lets the items in flight finish and write their results, and starts no new
one. The second abandons the items in flight: nothing is written for them, and a rerun sends them
again under the same key, so the proxy replays whatever the abandoned attempt achieved.
"""

from __future__ import annotations

import asyncio


class Stop:
    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.abandoned = asyncio.Event()

    def request(self) -> None:
        if self.requested.is_set():
            self.abandoned.set()
        self.requested.set()
