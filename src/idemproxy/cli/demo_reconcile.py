"""The sample backend's reconcile handler for `idemproxy demo` (SPEC §3.6, docs/attempts.md).

The backend remembers what it answered each attempt (by `Idempotency-Job` and
`Idempotency-Attempt`). Asked about one, it says "executed" with that answer, "still running"
(409, which proves nothing) while it runs, and "never executed" only once it is sure it never
will be: it keeps a tombstone and refuses the attempt if it arrives after all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Attempt = tuple[str, int]


@dataclass
class Answers:
    running: set[Attempt] = field(default_factory=set)
    given: dict[Attempt, dict[str, Any]] = field(default_factory=dict)
    tombstones: set[Attempt] = field(default_factory=set)


ANSWERS = web.AppKey("answers", Answers)


def attempt_of(request: web.Request) -> Attempt:
    headers = request.headers
    return headers.get("Idempotency-Job", ""), int(headers.get("Idempotency-Attempt", "0"))


async def reconcile(request: web.Request) -> web.Response:
    question = await request.json()
    attempt = (question["job"], question["attempt"])
    answers = request.app[ANSWERS]
    said: dict[str, Any] = {"job": attempt[0], "attempt": attempt[1]}
    if attempt in answers.running:
        return web.json_response(said, status=409)  # still running: ask again later
    if attempt in answers.given:
        body = json.dumps(answers.given[attempt])
        response = {"status": 201, "headers": [["Content-Type", "application/json"]], "body": body}
        return web.json_response({**said, "executed": True, "response": response})
    answers.tombstones.add(attempt)  # "never executed" must stay true
    return web.json_response({**said, "executed": False})
