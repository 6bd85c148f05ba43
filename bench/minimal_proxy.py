"""The yardstick: the least an idempotency proxy on PostgreSQL can do per new key.

Claim, forward, complete, and nothing else: aiohttp in front of the benchmark backend, asyncpg,
one table with a unique (owner, key), one owner. A request with an `Idempotency-Key` is claimed
(`INSERT … ON CONFLICT DO NOTHING`, a durable commit), forwarded, and its response stored (an
`UPDATE`, the second durable commit) before it is answered. A key already claimed is replayed
when its response is stored, refused with 409 otherwise; a request without a key is forwarded
untracked. No fingerprint check, no lease, no attempt rows, no expiry, no notification, no
batching, no cache, no metrics: what idemproxy does beyond this is what its semantics cost
(docs/benchmarks.md, "The minimal proxy").

    .venv/bin/python bench/minimal_proxy.py --listen 127.0.0.1:9200 \
        --upstream http://127.0.0.1:9100 --dsn postgresql://postgres@127.0.0.1/idemproxy_bench
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator

import asyncpg
import uvloop
from aiohttp import ClientSession, TCPConnector, web

OWNER = "anonymous"
SCHEMA = """
CREATE SCHEMA IF NOT EXISTS minimal;
CREATE TABLE IF NOT EXISTS minimal.jobs (
    owner   text NOT NULL,
    key     text NOT NULL,
    state   text NOT NULL DEFAULT 'in_flight',
    status  integer,
    headers text,
    body    bytea,
    UNIQUE (owner, key)
);
"""
CLAIM = (
    "INSERT INTO minimal.jobs (owner, key) VALUES ($1, $2)"
    " ON CONFLICT (owner, key) DO NOTHING RETURNING true"
)
READ = "SELECT state, status, headers, body FROM minimal.jobs WHERE owner = $1 AND key = $2"
COMPLETE = (
    "UPDATE minimal.jobs SET state = 'completed', status = $3, headers = $4, body = $5"
    " WHERE owner = $1 AND key = $2"
)
# The response headers passed on and stored; the rest (hop-by-hop, Date, Server) are not.
KEPT = ("Content-Type", "Location")
POOL = web.AppKey("pool", asyncpg.Pool)
CLIENT = web.AppKey("client", ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def forward(request: web.Request, body: bytes) -> tuple[int, dict[str, str], bytes]:
    headers = {k: v for k, v in request.headers.items() if k.title() in ("Content-Type",)}
    url = request.app[UPSTREAM] + request.path_qs
    async with request.app[CLIENT].request(
        request.method, url, data=body, headers=headers
    ) as upstream:
        payload = await upstream.read()
        kept = {name: upstream.headers[name] for name in KEPT if name in upstream.headers}
        return upstream.status, kept, payload


async def handle(request: web.Request) -> web.Response:
    body = await request.read()
    key = request.headers.get("Idempotency-Key")
    if key is None:
        status, headers, payload = await forward(request, body)
        return web.Response(status=status, headers=headers, body=payload)
    pool = request.app[POOL]
    if await pool.fetchval(CLAIM, OWNER, key) is None:
        row = await pool.fetchrow(READ, OWNER, key)
        if row is None or row["state"] != "completed":
            return web.json_response({"error": "in flight"}, status=409)
        stored = json.loads(row["headers"]) | {"Idempotent-Replayed": "true"}
        return web.Response(status=row["status"], headers=stored, body=row["body"])
    status, headers, payload = await forward(request, body)
    await pool.execute(COMPLETE, OWNER, key, status, json.dumps(headers), payload)
    return web.Response(status=status, headers=headers, body=payload)


def make_app(upstream: str, dsn: str, connections: int) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")

    async def resources(app: web.Application) -> AsyncIterator[None]:
        async with asyncpg.create_pool(dsn, min_size=2, max_size=connections) as pool:
            await pool.execute(SCHEMA)
            async with ClientSession(connector=TCPConnector(limit=0)) as client:
                app[POOL], app[CLIENT] = pool, client
                yield

    app.cleanup_ctx.append(resources)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--dsn", required=True)
    # idemproxy's default pool size (pool.store_connections): both may use as many.
    parser.add_argument("--connections", type=int, default=20)
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    app = make_app(args.upstream, args.dsn, args.connections)
    # uvloop, as `idemproxy serve` runs.
    loop = uvloop.new_event_loop()
    web.run_app(app, host=host, port=int(port), access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
