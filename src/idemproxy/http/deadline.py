"""A deadline that is set again for every request and rarely expires, on one timer.

The header-read deadline of a client connection (proxy/server/connection.py) and the wait for the
upstream on an upstream connection (proxy/upstream/client.py) are started and stopped one to
four times per request. Arming and cancelling an event loop timer each time costs more than the rest
of that bookkeeping (about 2 µs with uvloop; bench/findings.md). Here the deadline is a time, `due`,
and the owner's one timer, when it fires, calls `on_expiry` only if that time has passed, or is set
again for it: on a busy kept-alive connection it fires about once per timeout, not once per
request. The owner stops the deadline by setting `due` to None and tells whether one runs by
reading it: a field, not a call, on the path of every request. It starts it the same way when
the timer fires by the new `due` (`armed <= due`: nearly always, on a busy connection), and by
`start` otherwise.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

# Event loop timers fire to the millisecond (libuv's resolution): a timer that fires a little
# before its time counts as on time rather than being set again for the rest.
_SLACK_SECONDS = 0.001


class Deadline:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_expiry: Callable[[], None]) -> None:
        self._loop = loop
        self.time = loop.time  # the clock `due` is read on
        self._on_expiry = on_expiry
        self.due: float | None = None  # loop time; None while no deadline runs
        self._timer: asyncio.TimerHandle | None = None
        # Loop time at which the timer fires; infinite while there is none. A `due` at or after
        # it can be set as a field: the timer then checks it, and is set again for it.
        self.armed = math.inf

    def start(self, timeout: float) -> None:
        """Expire `timeout` seconds from now, unless stopped or started again before."""
        due = self._loop.time() + timeout
        self.due = due
        if self._timer is None:
            self._arm(due)
        elif self.armed > due + _SLACK_SECONDS:
            # A shorter timeout than the one the timer was set for (a route's own
            # `upstream_timeout` on a connection another route used before): firing later
            # would let this wait run past its deadline.
            self._timer.cancel()
            self._arm(due)

    def close(self) -> None:
        """Stop, and drop the timer and the callback (both refer to the owner, which refers to
        this deadline): when the connection is lost, reference counting then frees the owner
        at once, rather than the cyclic collector later."""
        self.due = None
        self._on_expiry = _expired_after_close
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.armed = math.inf

    def _arm(self, due: float) -> None:
        self._timer = self._loop.call_at(due, self._check)
        self.armed = due

    def _check(self) -> None:
        self._timer = None
        self.armed = math.inf
        due = self.due
        if due is None:
            return
        if self._loop.time() + _SLACK_SECONDS < due:  # started again since: wait for that
            self._arm(due)
            return
        self.due = None
        self._on_expiry()


def _expired_after_close() -> None:
    """What a closed deadline calls: nothing (it is never started again)."""
