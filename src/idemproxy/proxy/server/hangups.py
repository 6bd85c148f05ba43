"""A client that hangs up mid-request: one INFO line and a counter (SPEC §13).

It is routine (a mobile client losing signal, a load balancer's health check) and cheap to do on
purpose, so it must not cost aiohttp's 25-line traceback at ERROR per occurrence.
"""

from __future__ import annotations

import logging

from aiohttp import web

from idemproxy.observe.metrics import DisconnectStage, Metrics

log = logging.getLogger("idemproxy.proxy")

_WHEN = {
    DisconnectStage.REQUEST_BODY: "before its request body was complete",
    DisconnectStage.RESPONSE: "during a pass-through response",
}


def client_gone(metrics: Metrics, request: web.BaseRequest, stage: DisconnectStage) -> None:
    metrics.client_disconnect[stage].inc()
    log.info("client %s hung up %s", request.remote, _WHEN[stage])
