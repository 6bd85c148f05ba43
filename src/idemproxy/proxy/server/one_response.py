"""One response per request on a connection, whatever the code above it returns (SPEC §7).

HTTP/1.1 has no framing around a response but its own (RFC 9112 §6.3): bytes written after a
response are read by the client as the answer to its next request on the connection, which,
behind a load balancer that pools connections, may be another client's. A handler that streams
its answer prepares it itself; if a bug then made it return a different response (a problem, a
replay), aiohttp would write that one too. Here, instead, the connection is closed after the
response that started: a truncated answer the client can tell from a whole one, never a second.

Every head aiohttp writes is noted, so that the check does not depend on where in the proxy the
response was started: on the listener of `idemproxy serve` by its writer (`HeadWriter`,
proxy/server/head.py), which sees the head's fields but not the response; through the app's
router (aiohttp's own servers: tests, the demo) by `note_started`, the app's
`on_response_prepare` signal, which sees the response.
"""

from __future__ import annotations

import logging

from aiohttp import web

from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.server.connection import SentResponse
from idemproxy.proxy.server.head import HeadWriter
from idemproxy.redact import redact_path

log = logging.getLogger(__name__)
_STARTED = web.RequestKey("idemproxy_started_response", web.StreamResponse)


async def note_started(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: the response whose head is (about to be) written."""
    request[_STARTED] = response


def only_response(
    metrics: Metrics, request: web.Request, response: web.StreamResponse
) -> web.StreamResponse:
    """`response`, unless another one was started for this request: then that one (or, on the
    listener, what stands for it), with the connection closed, so that `response` is never
    written."""
    writer = request.writer
    if type(writer) is HeadWriter:  # the listener of `idemproxy serve`
        headers = writer.started_headers
        if headers is None or headers is response.headers:
            return response
        status = int(writer.started_line.split(" ", 2)[1])  # "HTTP/1.1 200 OK"
        # What aiohttp's loop gets instead: that response's status and fields, for the
        # request's log line and metrics; the connection is not kept.
        started: web.StreamResponse = SentResponse(persistent=False, status=status, headers=headers)
    else:
        # Only `note_started` puts anything in the request: an empty one started nothing.
        # Asked for a key it lacks, the request's `get` raises and catches a KeyError, on
        # every whole response (those never pass through the signal).
        noted: web.StreamResponse | None = request.get(_STARTED) if len(request) else None
        if noted is None or noted is response:
            return response
        started = noted
    _refuse_second(metrics, request, response, started)
    return started


def _refuse_second(
    metrics: Metrics,
    request: web.Request,
    response: web.StreamResponse,
    started: web.StreamResponse,
) -> None:
    metrics.second_responses.inc()
    log.error(
        "%s %s: a %d was returned after a %d had started; connection closed instead",
        request.method,
        redact_path(request.raw_path.partition("?")[0]),  # no query; no session id (SPEC §13)
        response.status,
        started.status,
    )
    started.force_close()
    if request.transport is not None:
        request.transport.close()
