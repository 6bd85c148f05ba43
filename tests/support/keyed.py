"""Backends for the tests of sending an `unknown` job again under its key (SPEC §3.6).

`Keyed` honours `Idempotency-Key` as payment APIs do: a key it finished answers its first
response again (executing nothing), a key still running answers 409, and a key seen with
another body answers 400. `honours=False` makes it a backend that does not: every request
executes. `answers` queues statuses for the next requests (answered without executing), and
`delay` slows the first request of each key (the proxy times out: `unknown`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.proxyapp import served


@dataclass
class Keyed:
    honours: bool = True
    delay: float = 0.0
    answers: list[int] = field(default_factory=list)
    executions: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    done: dict[str, tuple[bytes, dict[str, Any]]] = field(default_factory=dict)
    running: dict[str, bytes] = field(default_factory=dict)

    async def charge(self, request: web.Request) -> web.Response:
        key, body = request.headers["Idempotency-Key"], await request.read()
        self.requests[key] += 1
        if self.answers:
            return web.json_response({"error": "try later"}, status=self.answers.pop(0))
        if self.honours and key in self.done:
            first, answer = self.done[key]
            if first != body:
                return web.json_response({"error": "key reused with another body"}, status=400)
            return web.json_response(answer, status=201)
        if self.honours and key in self.running:
            return web.json_response({"error": "in progress"}, status=409)
        self.running[key] = body
        try:
            await asyncio.sleep(self.delay if self.requests[key] == 1 else 0)
        finally:
            del self.running[key]
        self.executions[key] += 1
        answer = {"charge": f"ch_{key}_{self.executions[key]}", "attempt": request.headers.get(
            "Idempotency-Attempt")}  # fmt: skip
        self.done[key] = (body, answer)
        return web.json_response(answer, status=201)


@asynccontextmanager
async def keyed_backend(keyed: Keyed) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/charges", keyed.charge)
    async with served(app) as url:
        yield url
