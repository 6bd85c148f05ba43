"""The soak's upstream: a recording backend behind a fault relay steered per request.

The client chooses each request's upstream fault with headers that the proxy forwards untouched
(headers are not part of the fingerprint, SPEC §6, so a retry may carry another fault):

  X-Soak-Fault   for the relay (tests/support/faultproxy.py): `reset-after-send` (the backend
                 executes, the relay resets before a response byte), `reset-mid-body`, `drip-ok`
                 (slow, within the upstream timeout), `drip-timeout` (slow, past it)
  X-Soak-Status  the backend's answer: 201 (default), 503 (a release status: the backend does
                 NOT execute), 502 or 504 (the backend executes, then answers as a gateway that
                 lost the response would)
  X-Soak-Delay   seconds the backend takes after executing (duplicates pile up behind the job)

Connection-level faults (refused connections, resets on accept) are not per request: the chaos
loop switches them on for a while (`SteeredRelay.refuse_for`, `inject`).

Every response body names the owner the backend saw (a hash of the `Authorization` it received),
the key, the job and attempt headers, a hash of the request body, and a fresh nonce, so that two
executions of one job can never produce the same body. The ledger records every request that
reached the backend, whether it executed, and a hash of the body it answered with.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aiohttp import web

from tests.support.faultproxy import (
    PASS,
    RESET_BEFORE_RESPONSE,
    RESET_ON_ACCEPT,
    Fault,
    FaultProxy,
    drip,
    reset_mid_body,
)

FAULT_HEADER = "X-Soak-Fault"
STATUS_HEADER = "X-Soak-Status"
DELAY_HEADER = "X-Soak-Delay"
NOT_EXECUTED_STATUSES = frozenset({503})  # the backend promises it did not process these
ANONYMOUS = "anonymous"

RELAY_FAULTS: dict[str, Fault] = {
    "reset-after-send": RESET_BEFORE_RESPONSE,
    "reset-mid-body": reset_mid_body(12),
    "drip-ok": drip(96, 0.05),  # about 0.3 s for a whole response
    "drip-timeout": drip(16, 0.5),  # about 15 s: well past the upstream timeout
}


def owner_marker(authorization: str | None) -> str:
    """What the backend echoes for the owner it saw, and what the client expects to see."""
    if not authorization:
        return ANONYMOUS
    return hashlib.sha256(authorization.encode()).hexdigest()[:16]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


@dataclass
class Arrival:
    """One request that reached the backend."""

    seq: int
    at: float  # seconds since the run began
    owner: str  # owner_marker of the Authorization received
    key: str | None
    job: str | None  # Idempotency-Job
    attempt: int | None  # Idempotency-Attempt
    payload_sha: str
    status: int
    executed: bool
    body_sha: str
    fault: str | None
    delay: float


@dataclass
class Ledger:
    started: float  # time.monotonic() at the start of the run
    arrivals: list[Arrival] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.started

    def write(self, path: Path) -> None:
        with path.open("w") as out:
            for arrival in self.arrivals:
                out.write(json.dumps(asdict(arrival), separators=(",", ":")) + "\n")


LEDGER = web.AppKey("ledger", Ledger)


async def _execute(request: web.Request) -> web.Response:
    body = await request.read()
    ledger = request.app[LEDGER]
    headers = request.headers
    status = int(headers.get(STATUS_HEADER, "201"))
    delay = float(headers.get(DELAY_HEADER, "0"))
    attempt = headers.get("Idempotency-Attempt")
    arrival = Arrival(
        seq=len(ledger.arrivals) + 1,
        at=ledger.now(),
        owner=owner_marker(headers.get("Authorization")),
        key=headers.get("Idempotency-Key"),
        job=headers.get("Idempotency-Job"),
        attempt=int(attempt) if attempt and attempt.isdigit() else None,
        payload_sha=sha(body),
        status=status,
        executed=status not in NOT_EXECUTED_STATUSES,
        body_sha="",
        fault=headers.get(FAULT_HEADER),
        delay=delay,
    )
    echoed = ("owner", "key", "job", "attempt", "payload_sha", "executed", "seq")
    answer = {name: getattr(arrival, name) for name in echoed}
    answer["nonce"] = secrets.token_hex(8)
    payload = json.dumps(answer, sort_keys=True).encode()
    arrival.body_sha = sha(payload)
    # Recorded before the delay: a proxy killed while the backend works leaves an execution.
    ledger.arrivals.append(arrival)
    if delay > 0:
        await asyncio.sleep(delay)
    return web.Response(status=status, body=payload, content_type="application/json")


def backend_app(ledger: Ledger) -> web.Application:
    app = web.Application()
    app[LEDGER] = ledger
    app.router.add_route("*", "/{tail:.*}", _execute)
    return app


async def start_backend(ledger: Ledger) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(backend_app(ledger), access_log=None, handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def _fault_of(request: bytes) -> str | None:
    head = request.split(b"\r\n\r\n", 1)[0]
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == FAULT_HEADER.lower().encode():
            return value.strip().decode("ascii", "replace")
    return None


@dataclass
class SteeredRelay(FaultProxy):
    """`FaultProxy` that takes each exchange's fault from the request's X-Soak-Fault header,
    can refuse new connections for a while, and keeps no copies of what it relayed."""

    applied: Counter[str] = field(default_factory=Counter)
    _idle: set[asyncio.StreamWriter] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._idle.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await super()._serve(reader, writer)
        except RuntimeError:
            # uvloop: writing (a drip) to a connection the proxy gave up on and closed raises
            # RuntimeError rather than a ConnectionError. The exchange is over all the same.
            if not writer.is_closing():
                raise
        finally:
            self._idle.discard(writer)
            if task is not None:
                self._tasks.discard(task)

    async def _exchange(
        self,
        request: bytes,
        backend: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        client: asyncio.StreamWriter,
    ) -> bool:
        name = _fault_of(request)
        fault = RELAY_FAULTS.get(name or "", PASS)
        if fault is not PASS:
            self.applied[name or ""] += 1
        # FaultProxy._exchange takes the head of the queue before its first await; PASS keeps
        # a queued RESET_ON_ACCEPT for the next new connection, where it belongs.
        self.faults.appendleft(fault)
        self._idle.discard(client)
        try:
            return await super()._exchange(request, backend, client)
        finally:
            self.exchanges.clear()
            if not client.is_closing():
                self._idle.add(client)

    async def refuse_for(self, seconds: float) -> int:
        """Stop listening (connections are refused), close the idle kept-alive connections
        with a FIN so that the proxies must connect anew, then listen again on the same port.
        Returns the number of idle connections closed."""
        if self._server is not None:
            self._server.close()  # no wait_closed: open exchanges go on
            self._server = None
        idle = list(self._idle)
        for writer in idle:
            writer.close()
        await asyncio.sleep(seconds)
        await self.start()
        return len(idle)

    def reset_next_connections(self, count: int) -> None:
        """The next `count` new connections are accepted, then reset before a byte is read."""
        self.faults.extend([RESET_ON_ACCEPT] * count)

    @property
    def resets_pending(self) -> int:
        return sum(1 for fault in self.faults if fault is RESET_ON_ACCEPT)

    async def close(self) -> None:
        """Stop listening and end every connection still open (dripping ones included)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
