"""A minimal, fast upstream for the benchmark: the proxy's cost should dominate, not this.

POST (any path) reads the body and answers 201 with a small JSON document; every other method
answers 200 with a small one. GET /_stats tells how many POSTs it executed, so that the harness
can check that replays never reach it; GET /_stats?prefix=P also counts the POSTs whose
Idempotency-Key (which the proxy passes on) starts with P, and the most any one of those keys
executed. A POST to /slow waits until GET /_release (the memory test holds duplicates behind it);
bodies over 64 KiB are drained without being kept. Runs on uvloop
with no access log, as one process:

    python bench/backend.py --listen 127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web

_GET_BODY = b'{"ok":true}'
_SMALL = 64 * 1024


@dataclass
class Stats:
    posts: int = 0
    slow_waiting: int = 0  # POSTs to /slow waiting for GET /_release
    release: asyncio.Event = field(default_factory=asyncio.Event)
    keys: dict[str, int] = field(default_factory=dict)  # POSTs per Idempotency-Key

    def counts(self, prefix: str | None) -> dict[str, int]:
        counts = {"posts": self.posts, "slow_waiting": self.slow_waiting}
        if prefix is not None:
            mine = [n for key, n in self.keys.items() if key.startswith(prefix)]
            counts |= {"keyed": sum(mine), "max_per_key": max(mine, default=0)}
        return counts


STATS = web.AppKey("stats", Stats)


async def _handle(request: web.Request) -> web.Response:
    if request.method == "POST":
        stats = request.app[STATS]
        if request.content_length is not None and request.content_length <= _SMALL:
            await request.read()
        else:
            async for _chunk in request.content.iter_any():
                pass
        if request.path == "/slow":
            stats.slow_waiting += 1
            await stats.release.wait()
            stats.slow_waiting -= 1
        stats.posts += 1
        key = request.headers.get("Idempotency-Key")
        if key is not None:
            stats.keys[key] = stats.keys.get(key, 0) + 1
        return web.Response(
            status=201,
            body=b'{"id":%d,"ok":true}' % stats.posts,
            content_type="application/json",
            headers={"Location": f"/things/{stats.posts}"},
        )
    if request.path == "/_stats":
        counts = request.app[STATS].counts(request.query.get("prefix"))
        return web.Response(body=json.dumps(counts).encode())
    if request.path == "/_release":
        request.app[STATS].release.set()
    return web.Response(status=200, body=_GET_BODY, content_type="application/json")


def create_app() -> web.Application:
    app = web.Application()
    app[STATS] = Stats()
    app.router.add_route("*", "/{tail:.*}", _handle)
    return app


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of idemproxy
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main() -> None:
    parser = argparse.ArgumentParser(description="idemproxy benchmark backend")
    parser.add_argument("--listen", default="127.0.0.1:9000", metavar="HOST:PORT")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    web.run_app(
        create_app(),
        host=host,
        port=int(port),
        loop=_new_loop(),
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
