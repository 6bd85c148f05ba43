"""Test-only crash points, for crash tests with real SIGKILLs.

`IDEMPROXY_TEST_FAILPOINT=<name>` makes the process kill itself with SIGKILL at that point of
the first governed request that reaches it. Never set it in production.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

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

    def on_sent(self) -> Callable[[], None] | None:
        """`after_send`: called by the upstream client once the request's bytes were handed
        to the kernel (on the loop turn after the write)."""
        if self.armed != "after_send":
            return None
        return lambda: self.hit("after_send")
