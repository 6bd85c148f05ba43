"""A backend with a reconcile endpoint (SPEC §3.6), for the tests of unknown jobs that resolve
themselves. It executes `POST /payments` (counting executions per key and remembering each
attempt's answer by its `Idempotency-Job` and `Idempotency-Attempt`), and answers `POST
/reconcile` honestly, or in one of the hostile ways a test picks (`Payments.mode`).

A first attempt (`Idempotency-Attempt: 1`) executes after `delay` seconds (the proxy times out
first: `unknown`), or, with `drop` set, waits that long and is dropped without executing.

Honest answers are what docs/attempts.md asks of a reconcile handler: "executed" with the
response given; "still running" (a 409, which proves nothing) while the attempt is in progress;
and "never executed" only once it is sure never to be: it keeps a tombstone, and the attempt, if
it arrives late, is refused rather than executed.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.proxyapp import served

HONEST = "honest"
# Hostile answers: none of them proves anything.
HOSTILE = (
    "garbage", "html", "error", "other_job", "other_attempt", "slow", "maybe", "reset",
    "unreplayable",
)  # fmt: skip


@dataclass
class Payments:
    mode: str = HONEST
    delay: float = 0.0
    drop: float | None = None
    slow_seconds: float = 5.0
    executions: Counter[str] = field(default_factory=Counter)  # by Idempotency-Key
    answers: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    running: set[tuple[str, int]] = field(default_factory=set)
    tombstones: set[tuple[str, int]] = field(default_factory=set)
    questions: list[dict[str, Any]] = field(default_factory=list)
    question_headers: list[dict[str, str]] = field(default_factory=list)
    # Called with the question before it is answered (a test's operator acting meanwhile).
    before_answer: Any = None

    async def pay(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = request.headers
        this = (headers["Idempotency-Job"], int(headers["Idempotency-Attempt"]))
        first = this[1] == 1
        if first and self.drop is not None:
            await asyncio.sleep(self.drop)
            raise web.HTTPServiceUnavailable()  # never executed; the proxy gave up long ago
        self.running.add(this)
        try:
            await asyncio.sleep(self.delay if first else 0)
        finally:
            self.running.discard(this)
        if this in self.tombstones:  # answered "never executed": it must stay so
            raise web.HTTPConflict()
        key = headers["Idempotency-Key"]
        self.executions[key] += 1
        answer = {"charged": json.loads(body or b"{}"), "execution": self.executions[key]}
        self.answers[this] = answer
        return web.json_response(answer, status=201)

    async def reconcile(self, request: web.Request) -> web.StreamResponse:
        question = await request.json()
        self.questions.append(question)
        self.question_headers.append(dict(request.headers))
        if self.before_answer is not None:
            await self.before_answer(question)
        if self.mode == HONEST:
            return self._honest(question)
        return await self._hostile(question, request)

    def _honest(self, question: dict[str, Any]) -> web.Response:
        job, attempt = question["job"], question["attempt"]
        if (job, attempt) in self.running:
            return web.json_response({"job": job, "attempt": attempt}, status=409)
        if (job, attempt) not in self.answers:
            self.tombstones.add((job, attempt))
        return web.json_response(self._truth(question))

    def _truth(self, question: dict[str, Any]) -> dict[str, Any]:
        job, attempt = question["job"], question["attempt"]
        executed = (job, attempt) in self.answers
        truth: dict[str, Any] = {"job": job, "attempt": attempt, "executed": executed}
        if executed:
            truth["response"] = {
                "status": 201,
                "headers": [["Content-Type", "application/json"]],
                "body": json.dumps(self.answers[(job, attempt)]),
            }
        return truth

    async def _hostile(self, question: dict[str, Any], request: web.Request) -> web.StreamResponse:
        honest, attempt = self._truth(question), question["attempt"]
        match self.mode:
            case "garbage":
                return web.Response(body=b"\x00{not json")
            case "html":
                return web.Response(text="<html>ok</html>", content_type="text/html")
            case "error":
                return web.json_response({**honest, "executed": False}, status=500)
            case "other_job":
                return web.json_response({**honest, "job": "another", "executed": False})
            case "other_attempt":
                return web.json_response({**honest, "attempt": attempt + 1, "executed": False})
            case "slow":
                await asyncio.sleep(self.slow_seconds)
                return web.json_response({**honest, "executed": False})
            case "maybe":
                return web.json_response({**honest, "executed": "probably not"})
            case "unreplayable":  # a header no replay may carry
                response = {"status": 200, "headers": [["Transfer-Encoding", "chunked"]]}
                return web.json_response({**honest, "executed": True, "response": response})
            case "reset":
                assert request.transport is not None
                request.transport.close()
                return web.Response()
            case _:
                raise AssertionError(f"no such mode: {self.mode}")


@asynccontextmanager
async def payments_backend(payments: Payments) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/payments", payments.pay)
    app.router.add_post("/reconcile", payments.reconcile)
    async with served(app) as url:
        yield url
