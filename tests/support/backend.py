"""A real upstream for the tests: an aiohttp app that records every request it executes.

Behaviour is chosen per request by query parameters, so one server covers every case:
  status=N   answer with status N            delay=S   sleep S seconds before answering
  size=N     answer with N bytes of body     gzip=1    gzip-encode the body (Content-Encoding)
  cookie=1   add a Set-Cookie header         chunked=1 stream the body in chunks
The JSON body (unless size/gzip) echoes the method, path, query, request headers and body, and
carries `execution`, the 1-based count of requests this backend executed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Execution:
    method: str
    path_qs: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None


@dataclass
class Ledger:
    executions: list[Execution] = field(default_factory=list)
    # Keys of requests that reached the handler, recorded before any delay: a test can wait
    # until a request is in flight upstream instead of guessing how long that takes.
    arrivals: list[str | None] = field(default_factory=list)

    def count(self, key: str | None = None) -> int:
        if key is None:
            return len(self.executions)
        return sum(1 for e in self.executions if e.header("Idempotency-Key") == key)


LEDGER = web.AppKey("ledger", Ledger)


async def _handle(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    query = request.query
    request.app[LEDGER].arrivals.append(request.headers.get("Idempotency-Key"))
    if "delay" in query:
        await asyncio.sleep(float(query["delay"]))
    ledger = request.app[LEDGER]
    ledger.executions.append(
        Execution(request.method, request.path_qs, list(request.headers.items()), body)
    )
    status = int(query.get("status", "201"))
    if "size" in query:
        payload = bytes(i % 251 for i in range(int(query["size"])))
        content_type = "application/octet-stream"
    else:
        payload = json.dumps(_echo(request, body, len(ledger.executions))).encode()
        content_type = "application/json"
    headers = {"Location": f"/things/{len(ledger.executions)}", "ETag": '"v1"'}
    if "cookie" in query:
        headers["Set-Cookie"] = "session=secret; HttpOnly"
    if "gzip" in query:
        payload = gzip.compress(payload, mtime=0)
        headers["Content-Encoding"] = "gzip"
    if status in (204, 304):
        return web.Response(status=status, headers=headers)
    if "chunked" in query:
        return await _stream(request, status, headers, content_type, payload)
    return web.Response(status=status, body=payload, headers=headers, content_type=content_type)


async def _stream(
    request: web.Request, status: int, headers: dict[str, str], content_type: str, payload: bytes
) -> web.StreamResponse:
    response = web.StreamResponse(status=status, headers=headers)
    response.content_type = content_type
    response.enable_chunked_encoding()
    await response.prepare(request)
    for start in range(0, len(payload), 1000):
        await response.write(payload[start : start + 1000])
    await response.write_eof()
    return response


def _echo(request: web.Request, body: bytes, execution: int) -> dict[str, Any]:
    return {
        "execution": execution,
        "method": request.method,
        "path": request.path,
        "query": request.query_string,
        "headers": [[k, v] for k, v in request.headers.items()],
        "body": body.decode("utf-8", "replace"),
    }


def backend_app(ledger: Ledger | None = None) -> web.Application:
    app = web.Application()
    app[LEDGER] = ledger or Ledger()
    app.router.add_route("*", "/{tail:.*}", _handle)
    return app


@contextlib.asynccontextmanager
async def serving(ledger: Ledger) -> AsyncIterator[str]:
    """`backend_app(ledger)` on 127.0.0.1, an ephemeral port, for the block; yields its URL.

    As `idemproxy serve` and a typical backend do, a handler keeps executing when its client
    hangs up (handler_cancellation=False)."""
    runner = web.AppRunner(backend_app(ledger), access_log=None, handler_cancellation=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
