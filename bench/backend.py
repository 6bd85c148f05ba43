"""A minimal, fast upstream for the benchmark: the proxy's cost should dominate, not this.

POST (any path) reads the body and answers 201 with a small JSON document; every other method
answers 200 with a small one. GET /_stats tells how many POSTs it executed, so that the harness
can check that replays never reach it. Runs on uvloop with no access log, as one process:

    python bench/backend.py --listen 127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass

from aiohttp import web

_GET_BODY = b'{"ok":true}'


@dataclass
class Stats:
    posts: int = 0


STATS = web.AppKey("stats", Stats)


async def _handle(request: web.Request) -> web.Response:
    if request.method == "POST":
        await request.read()
        stats = request.app[STATS]
        stats.posts += 1
        return web.Response(
            status=201,
            body=b'{"id":%d,"ok":true}' % stats.posts,
            content_type="application/json",
            headers={"Location": f"/things/{stats.posts}"},
        )
    if request.path == "/_stats":
        return web.Response(body=json.dumps({"posts": request.app[STATS].posts}).encode())
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
