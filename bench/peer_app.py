"""The peer: what users would pick instead of idemproxy, doing the same work in-process.

The benchmark backend's POST (201 with a small JSON document, a Location header and a POST
counter at GET /_stats) as a Starlette app served by uvicorn (uvloop, httptools, one process, no
access log), behind asgi-idempotency-header's `IdempotencyHeaderMiddleware` with its Redis
backend. Runs in the benchmark's own virtualenv (bench/requirements-bench.txt), not the
project's:

    build/bench-peer-venv/bin/python bench/peer_app.py --listen 127.0.0.1:9100 \
        --redis redis://127.0.0.1:6380/0

What the middleware does per request with a key (idempotency_header_middleware 0.2.0): a Redis GET
for a stored response (a replay is a second GET for its status and a JSON re-encoding, then
done); otherwise SADD of the key to one set (a key already in it is a 409 at once: duplicates in
flight are not held), the endpoint, then SET, SET, EXPIRE, EXPIRE of the response. There is no
fingerprint, no owner scope, no state for a failed call and no durability beyond Redis's own.
"""

from __future__ import annotations

import argparse

import uvicorn
from idempotency_header_middleware import IdempotencyHeaderMiddleware
from idempotency_header_middleware.backends.redis import RedisBackend
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


class Counter:
    posts = 0
    keys: dict[str, int] = {}  # noqa: RUF012  (one app per process)


async def create(request: Request) -> Response:
    await request.body()
    Counter.posts += 1
    key = request.headers.get("idempotency-key")
    if key is not None:
        Counter.keys[key] = Counter.keys.get(key, 0) + 1
    return JSONResponse(
        {"id": Counter.posts, "ok": True},
        status_code=201,
        headers={"Location": f"/things/{Counter.posts}"},
    )


async def stats(request: Request) -> Response:
    """Like the backend's: GET /_stats?prefix=P also counts the POSTs of keys starting with P."""
    counts = {"posts": Counter.posts}
    prefix = request.query_params.get("prefix")
    if prefix is not None:
        mine = [n for key, n in Counter.keys.items() if key.startswith(prefix)]
        counts |= {"keyed": sum(mine), "max_per_key": max(mine, default=0)}
    return JSONResponse(counts)


async def root(_request: Request) -> Response:
    return JSONResponse({"ok": True})


def create_app(redis_url: str) -> Starlette:
    backend = RedisBackend(redis=Redis.from_url(redis_url))
    return Starlette(
        routes=[
            Route("/_stats", stats, methods=["GET"]),
            Route("/", root, methods=["GET"]),
            Route("/{path:path}", create, methods=["POST"]),
        ],
        # The library's __call__ is annotated to return a response, not None (its own typing).
        middleware=[Middleware(IdempotencyHeaderMiddleware, backend=backend)],  # type: ignore[arg-type]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="the benchmark's peer: Starlette + middleware")
    parser.add_argument("--listen", default="127.0.0.1:9100", metavar="HOST:PORT")
    parser.add_argument("--redis", required=True, metavar="URL")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    uvicorn.run(
        create_app(args.redis),
        host=host,
        port=int(port),
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        workers=None,
    )


if __name__ == "__main__":
    main()
