"""The status lookup (SPEC §7.1): what became of a key, answered by the proxy from the store.

Never forwarded and never a claim: a client that lost its answer can ask without any risk of an
execution. Scoped by owner as a replay is, and an unknown key and another owner's key get the
same `404`, so nobody learns which keys others use.
"""

from __future__ import annotations

import json

from aiohttp import web

from idemproxy.core.states import EXPIRABLE
from idemproxy.core.types import Job, JobState
from idemproxy.errors import KeyNotFound
from idemproxy.identity.fingerprint import parse_key
from idemproxy.observe.metrics import RequestOutcome
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.intent import refuse_hidden, request_owners
from idemproxy.proxy.routing import Route
from idemproxy.proxy.server.trace import Trace


async def answer_status(
    ctx: ProxyContext, request: web.Request, route: Route, trace: Trace
) -> web.StreamResponse:
    trace.outcome = RequestOutcome.STATUS_LOOKUP
    header = ctx.status_header or ""
    key = parse_key(request.headers.getall(header, []))
    if key is None:  # the header is there (the handler saw it), so this is never reached
        raise KeyNotFound()
    if route.key_source is not None:
        key = route.key_source.prefixed(key)
    if route.webhook is not None:
        # SPEC §4.2: a webhook route's jobs belong to its sender, whom no lookup can prove
        # to be; operators see them with `idemproxy jobs list --owner webhook:<sender>`.
        raise KeyNotFound()
    # SPEC §5, §7.1: the owner header named in `Connection` is refused as on a governed request.
    refuse_hidden(request, ctx.owner.header)
    owner, legacy = await request_owners(ctx, request)
    trace.owner = owner
    job = await ctx.store.get(owner, key)
    if job is None and legacy is not None:  # SPEC §5: a job from before `owner.pepper`
        job = await ctx.store.get(legacy, key)
    # SPEC §3.1: only completed and released jobs expire; an unknown or in-flight one past its
    # ttl is still there, and "not found" (new-key-safe) would invite a second execution.
    if job is None or (job.expired and job.state in EXPIRABLE):
        raise KeyNotFound()
    trace.job_id = job.id
    return web.Response(
        body=json.dumps(status_document(job)).encode(),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def status_document(job: Job) -> dict[str, object]:
    """The job's state, how many attempts it had and, once completed, the stored status."""
    document: dict[str, object] = {
        "key": job.key,
        "job": job.id,
        "state": str(job.state),
        "attempts": job.attempt_count,
    }
    if job.state is JobState.COMPLETED and job.response is not None:
        document["status"] = job.response.status
    return document
