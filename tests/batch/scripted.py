"""A scripted API for the runner's own tests, standing in for the proxy (a fake, named as such).

The item's query string says how to answer, counted per Idempotency-Key:
  fail=N&status=S     the first N calls answer S (with `Retry-After: 0`), later ones 201
  code=C              failures carry `Idempotency-Error: C` (e.g. request-in-flight)
  after=S             failures carry `Retry-After: S` instead of 0
  replayed=1          failures after the first say `Idempotent-Replayed: true`, as a proxy
                      replaying the upstream's stored answer does
  replay=1            the first success after failures says `Idempotent-Replayed: true`
  omit=1              successes after the first are replays without a body,
                      `Idempotency-Replay: omitted` (SPEC §7)
  delay=S[&slow=N]    sleep S seconds before answering (only the first N calls)
  size=N              pad the answer with N bytes
The real proxy stands in front of a real endpoint in test_end_to_end.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

from idemproxy.constants import ERROR_HEADER, REPLAY_OMITTED_HEADER, REPLAYED_HEADER


@dataclass
class Calls:
    by_key: Counter[str] = field(default_factory=Counter)
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def reached(self, count: int) -> None:
        """Wait until `count` calls have arrived in total."""
        async with self.arrived:
            await self.arrived.wait_for(lambda: self.by_key.total() >= count)


CALLS = web.AppKey("calls", Calls)


async def _answer(request: web.Request) -> web.Response:
    calls = request.app[CALLS]
    key = request.headers.get("Idempotency-Key", "")
    calls.by_key[key] += 1
    calls.headers.append(dict(request.headers))
    calls.bodies.append(await request.read())
    async with calls.arrived:
        calls.arrived.notify_all()
    query = request.query
    if calls.by_key[key] <= int(query.get("slow", "1000000")):
        await asyncio.sleep(float(query.get("delay", "0")))
    again = calls.by_key[key] > 1
    if calls.by_key[key] <= int(query.get("fail", "0")):
        headers = {"Retry-After": query.get("after", "0")}
        if "code" in query:
            headers[ERROR_HEADER] = query["code"]
        if "replayed" in query and again:
            headers[REPLAYED_HEADER] = "true"
        return web.json_response({"failed": True}, status=int(query["status"]), headers=headers)
    if "omit" in query and again:
        omitted = {REPLAYED_HEADER: "true", REPLAY_OMITTED_HEADER: "omitted"}
        return web.Response(status=201, headers=omitted)
    headers = {REPLAYED_HEADER: "true"} if "replay" in query and again else {}
    answer = {"key": key, "call": calls.by_key[key], "pad": "x" * int(query.get("size", "0"))}
    return web.json_response(answer, status=201, headers=headers)


def scripted_app(calls: Calls) -> web.Application:
    app = web.Application()
    app[CALLS] = calls
    app.router.add_route("*", "/{tail:.*}", _answer)
    return app
