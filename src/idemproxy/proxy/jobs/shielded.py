"""The attempts of a claimed job, run so that the client cannot cut them off (SPEC §2)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from idemproxy.core.types import Claimed
from idemproxy.errors import UpstreamTimeout
from idemproxy.proxy.jobs.request import GovernedRequest
from idemproxy.proxy.server.capture import drop_unsent

_CUT_OFF = (
    "The proxy shut down before the upstream answered; the request may have executed. Retries "
    "with this Idempotency-Key get 409 outcome-unknown until an operator resolves the job."
)
# The client's response, or None when another attempt completed the job first (jobrun.py).
RunJob = Callable[[GovernedRequest, Claimed], Coroutine[Any, Any, web.StreamResponse | None]]


class Shield:
    """Runs a claimed job's attempts (`run_job`) in a task of their own, kept in `attempts`
    (shutdown waits for them)."""

    __slots__ = ("_attempts", "_run_job")

    def __init__(self, run_job: RunJob, attempts: set[asyncio.Task[Any]]) -> None:
        self._run_job = run_job
        self._attempts = attempts

    async def run(self, governed: GovernedRequest, claimed: Claimed) -> web.StreamResponse | None:
        """SPEC §2: the client disconnecting must not cancel the upstream call or the
        completion."""
        task = asyncio.create_task(self._run_job(governed, claimed))
        self._attempts.add(task)
        task.add_done_callback(self._attempts.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not _cut_off_by_shutdown(task, governed.request):
                # The client left: the attempt goes on, and its response is never sent.
                task.add_done_callback(_drop_result)
                raise
        # SPEC §3.2: the drain's deadline cancelled the attempt and its job is unknown. The
        # first client gets a 504 as for any attempt whose outcome is unknown, not a bare
        # disconnect (unless the response had already started); retries get 409
        # outcome-unknown.
        raise UpstreamTimeout(_CUT_OFF)


def _drop_result(task: asyncio.Task[web.StreamResponse | None]) -> None:
    if not task.cancelled() and task.exception() is None:
        drop_unsent(task.result())


def _cut_off_by_shutdown(
    task: asyncio.Task[web.StreamResponse | None], request: web.Request
) -> bool:
    this = asyncio.current_task()
    return (
        task.cancelled()
        and (this is None or not this.cancelling())
        and request.writer.output_size == 0
    )
