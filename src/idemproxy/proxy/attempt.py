"""Running one attempt: forward, classify the result, store it, answer the client (SPEC §2.4, §3.2).

An attempt runs in its own task (see `governed.run_shielded`), so a client that hangs up cannot
stop the upstream call or the completion write.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from idemproxy.constants import ATTEMPT_HEADER, JOB_HEADER
from idemproxy.decision import Outcome, classify_failure, classify_response
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.forward import UpstreamClient, UpstreamFailure
from idemproxy.proxy.headers import headers_to_store, response_headers_for_client
from idemproxy.proxy.lease import lease_kept
from idemproxy.proxy.passthrough import forwarded_headers, upstream_url
from idemproxy.proxy.problems import problem_response
from idemproxy.proxy.routing import Route
from idemproxy.types import Claimed, Job, JobState, StoredResponse

log = logging.getLogger(__name__)
_SETTLED_STATE = {Outcome.RELEASE: JobState.RELEASED, Outcome.UNKNOWN: JobState.UNKNOWN}


async def run_attempt(
    ctx: ProxyContext, request: web.Request, route: Route, claimed: Claimed, body: bytes
) -> web.StreamResponse | None:
    """The client's response, or None when another attempt won the completion CAS."""
    job, number = claimed.job, claimed.attempt
    headers = forwarded_headers(request)
    headers[JOB_HEADER] = job.id  # SPEC §10: the backend can honour the same identity
    headers[ATTEMPT_HEADER] = str(number)
    try:
        async with (
            lease_kept(ctx.store, job, lease=ctx.settings.lease),
            ctx.upstream.request(
                request.method, upstream_url(route, request), headers, body
            ) as upstream,
        ):
            outcome = classify_response(upstream.status, ctx.statuses)
            content, whole = await UpstreamClient.read_body(upstream, ctx.settings.max_stored_body)
            if whole:
                return await _finish_buffered(ctx, route, job, number, upstream, outcome, content)
            return await _finish_streamed(
                ctx, request, route, job, number, upstream, outcome, content
            )
    except UpstreamFailure as failure:
        outcome, problem = classify_failure(failure.failure)
        await _settle(ctx, job, number, outcome, status=None, error=failure.reason)
        return problem_response(problem(), profile=ctx.settings.profile)
    except asyncio.CancelledError:
        # Cut off by shutdown: the request may have reached the upstream (SPEC §3.2).
        await asyncio.shield(
            _settle(ctx, job, number, Outcome.UNKNOWN, status=None, error="cut off by shutdown")
        )
        raise


async def _finish_buffered(
    ctx: ProxyContext,
    route: Route,
    job: Job,
    number: int,
    upstream: aiohttp.ClientResponse,
    outcome: Outcome,
    content: bytes,
) -> web.StreamResponse | None:
    # The outcome is stored before the client sees a byte: a client that retries after a lost
    # response always finds it.
    if outcome is Outcome.COMPLETE:
        stored = StoredResponse(
            upstream.status,
            headers_to_store(upstream.headers, ctx.settings.unreplayed_headers),
            content,
        )
        ctx.failpoints.hit("before_store")
        if not await ctx.store.complete(job, number, stored, ttl=route.ttl):
            log.info("late result discarded: job %s attempt %d lost the CAS", job.id, number)
            return None
        ctx.failpoints.hit("after_store")
    else:
        await _settle(ctx, job, number, outcome, status=upstream.status, error=None)
    response = web.Response(
        status=upstream.status,
        reason=upstream.reason,
        body=content,
        headers=_client_headers(upstream, job),
    )
    return response


async def _finish_streamed(
    ctx: ProxyContext,
    request: web.Request,
    route: Route,
    job: Job,
    number: int,
    upstream: aiohttp.ClientResponse,
    outcome: Outcome,
    head: bytes,
) -> web.StreamResponse:
    """SPEC §7: a body over max_stored_body streams through in full and is not kept."""
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    response.headers.extend(_client_headers(upstream, job))
    if upstream.content_length is not None:
        response.content_length = upstream.content_length
    client = _ClientSink(request, response)
    await client.write(head)
    try:
        async for chunk in UpstreamClient.iter_body(upstream):
            await client.write(chunk)
    except UpstreamFailure as failure:
        await _settle(
            ctx, job, number, Outcome.UNKNOWN, status=upstream.status, error=failure.reason
        )
        client.abort()
        return response
    if outcome is Outcome.COMPLETE:
        headers = headers_to_store(upstream.headers, ctx.settings.unreplayed_headers)
        await ctx.store.complete(
            job, number, StoredResponse(upstream.status, headers, None), ttl=route.ttl
        )
    else:
        await _settle(ctx, job, number, outcome, status=upstream.status, error=None)
    await client.finish()
    return response


class _ClientSink:
    """Writes to the first client, and keeps going quietly once it has hung up."""

    def __init__(self, request: web.Request, response: web.StreamResponse) -> None:
        self._request = request
        self._response = response
        self.gone = False

    async def write(self, chunk: bytes) -> None:
        if self.gone:
            return
        try:
            if not self._response.prepared:
                await self._response.prepare(self._request)
            await self._response.write(chunk)
        except (ConnectionError, RuntimeError):
            self.gone = True

    async def finish(self) -> None:
        if not self.gone:
            await self.write(b"")
            try:
                await self._response.write_eof()
            except (ConnectionError, RuntimeError):
                self.gone = True

    def abort(self) -> None:
        # The status line is out already: closing the connection is the only honest signal.
        self._response.force_close()
        if self._request.transport is not None:
            self._request.transport.close()


def _client_headers(upstream: aiohttp.ClientResponse, job: Job) -> CIMultiDict[str]:
    headers = response_headers_for_client(upstream.headers)
    headers[JOB_HEADER] = job.id
    return headers


async def _settle(
    ctx: ProxyContext,
    job: Job,
    number: int,
    outcome: Outcome,
    *,
    status: int | None,
    error: str | None,
) -> None:
    state = _SETTLED_STATE[outcome]
    if not await ctx.store.settle(job, number, state, status=status, error=error):
        log.info("job %s attempt %d: settle to %s lost the CAS", job.id, number, state)
