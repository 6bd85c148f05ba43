"""`idemproxy demo`: a sample payments backend behind the proxy on the embedded store.

It fires a double click, a retry after a lost response, a reused key with another amount and
an upstream timeout that resolves itself (the backend's reconcile endpoint, SPEC §3.6), and
shows that the backend executed once per intent.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from idemproxy.cli.demo_reconcile import ANSWERS, Answers, attempt_of, reconcile
from idemproxy.config.settings import Settings, load_settings
from idemproxy.proxy.app import create_app

EXECUTIONS = web.AppKey("executions", list)
_MAX_RETRIES = 10


async def create_payment(request: web.Request) -> web.Response:
    """The sample backend: every call is a new charge, exactly what must not happen twice."""
    payload = await request.json()
    answers, attempt = request.app[ANSWERS], attempt_of(request)
    answers.running.add(attempt)
    try:
        await asyncio.sleep(float(request.headers.get("X-Demo-Delay", "0.05")))
    finally:
        answers.running.discard(attempt)
    if attempt in answers.tombstones:  # it told the proxy "never executed"
        raise web.HTTPConflict()
    executions = request.app[EXECUTIONS]
    executions.append(payload)
    payment_id = f"pay_{len(executions)}"
    answer = {"id": payment_id, "amount": payload["amount"], "status": "charged"}
    answers.given[attempt] = answer
    return web.json_response(answer, status=201, headers={"Location": f"/payments/{payment_id}"})


def sample_backend() -> web.Application:
    app = web.Application()
    app[EXECUTIONS] = []
    app[ANSWERS] = Answers()
    app.router.add_post("/payments", create_payment)
    app.router.add_post("/reconcile", reconcile)
    return app


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def _post(
    session: aiohttp.ClientSession, url: str, key: str, amount: int, **headers: str
) -> str:
    async with session.post(
        f"{url}/payments",
        json={"amount": amount, "currency": "EUR"},
        headers={"Idempotency-Key": key, "Authorization": "Bearer demo-user", **headers},
    ) as response:
        body: Any = await response.json(content_type=None)
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        shown = body.get("id") or body.get("code")
        return f"{response.status} {shown}" + (" (replayed)" if replayed else "")


async def run_demo() -> int:
    backend_runner, backend_url = await start_app(backend := sample_backend())
    with tempfile.TemporaryDirectory() as folder:
        settings = demo_settings(backend_url, Path(folder) / "idemproxy.db")
        proxy_runner, proxy_url = await start_app(create_app(settings))
        try:
            await _scenarios(proxy_url)
        finally:
            await proxy_runner.cleanup()
            await backend_runner.cleanup()
    executions = backend[EXECUTIONS]
    print(f"\nThe backend charged {len(executions)} time(s) for 3 intents:")
    for payload in executions:
        print(f"  {json.dumps(payload)}")
    return 0 if len(executions) == 3 else 1


def demo_settings(backend_url: str, database: Path) -> Settings:
    # SPEC §3.6: an unknown outcome is asked about at the backend's reconcile endpoint.
    reconcile = {"url": f"{backend_url}/reconcile", "timeout": 0.5, "backoff": 0.2,
                 "max_backoff": 0.5}  # fmt: skip
    route = {"prefix": "/", "upstream": backend_url, "upstream_timeout": 1,
             "resolve": {"reconcile": reconcile}}  # fmt: skip
    return load_settings(
        routes=[route], store=f"sqlite:///{database}", listen="127.0.0.1:0",
        sweeper={"reconcile_interval": 0.1},
    )  # fmt: skip


async def _scenarios(proxy: str) -> None:
    async with aiohttp.ClientSession() as session:
        print("1. Double click: two identical POSTs at once with key order-1")
        first, second = await asyncio.gather(
            _post(session, proxy, "order-1", 100), _post(session, proxy, "order-1", 100)
        )
        print(f"   first click  → {first}\n   second click → {second}")

        print("2. Lost response: the client gives up after 0.2 s, the charge takes 0.6 s")
        try:
            async with asyncio.timeout(0.2):
                await _post(session, proxy, "order-2", 250, **{"X-Demo-Delay": "0.6"})
        except TimeoutError:
            print("   first try    → (no answer: connection lost)")
        await asyncio.sleep(0.3)
        print(f"   retry        → {await _post(session, proxy, 'order-2', 250)}")

        print("3. Same key order-1, different amount (a bug or an attack)")
        print(f"   request      → {await _post(session, proxy, 'order-1', 999)}")
        await _resolving_itself(session, proxy)


async def _resolving_itself(session: aiohttp.ClientSession, proxy: str) -> None:
    print("4. Upstream timeout: the proxy gives up after 1 s, the charge takes 1.5 s")
    answer = await _post(session, proxy, "order-3", 75, **{"X-Demo-Delay": "1.5"})
    print(f"   first try    → {answer}: the outcome is unknown")
    # SPEC §3.6: meanwhile the proxy asks the backend's reconcile endpoint, with backoff; a
    # retry is told when the next question is due (Retry-After), and follows it.
    for _ in range(_MAX_RETRIES):
        answer, wait = await _retry(session, proxy, "order-3", 75)
        print(f"   retry        → {answer}")
        if wait is None:
            return
        await asyncio.sleep(wait)


async def _retry(
    session: aiohttp.ClientSession, url: str, key: str, amount: int
) -> tuple[str, float | None]:
    async with session.post(
        f"{url}/payments",
        json={"amount": amount, "currency": "EUR"},
        headers={"Idempotency-Key": key, "Authorization": "Bearer demo-user"},
    ) as response:
        body: Any = await response.json(content_type=None)
        if response.status != 409:
            replayed = response.headers.get("Idempotent-Replayed") == "true"
            return f"{response.status} {body.get('id')}" + (" (replayed)" if replayed else ""), None
        wait = float(response.headers.get("Retry-After", "1"))
        return f"409 {body.get('code')}, Retry-After: {wait:g} s", wait
