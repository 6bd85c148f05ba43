"""A fake paid endpoint (named as such): every call it executes is a charge.

It counts charges per `Idempotency-Key`, so a test can tell "300 items, 300 charges" from
"300 items, 301 charges"; it sleeps a little per call so that a batch runs long enough to be
killed mid-way. `POST /charge?status=N` answers N instead (a failure is not a charge).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Charges:
    delay: float = 0.0
    by_key: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_key.values())

    def doubled(self) -> list[str]:
        return [key for key, count in self.by_key.items() if count > 1]


CHARGES = web.AppKey("charges", Charges)


async def _charge(request: web.Request) -> web.Response:
    charges = request.app[CHARGES]
    payload = await request.json() if request.can_read_body else None
    await asyncio.sleep(charges.delay)
    status = int(request.query.get("status", "201"))
    if status >= 400:
        return web.json_response({"error": "declined"}, status=status)
    key = request.headers.get("Idempotency-Key", "")
    charges.by_key[key] += 1
    return web.json_response({"charge": charges.total, "key": key, "echo": payload}, status=status)


def paid_app(charges: Charges) -> web.Application:
    app = web.Application()
    app[CHARGES] = charges
    app.router.add_route("*", "/{tail:.*}", _charge)
    return app
