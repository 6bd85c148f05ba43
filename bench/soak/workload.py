"""The soak's clients: mixed owners, a key space full of duplicates, and a history of it all.

Each of `clients` workers sends one request at a time to one of the proxies (chosen at random,
as a load balancer that knows nothing of their health would) and records it. A request is:

  new           a key never sent before, by a random owner
  duplicate     a recent (owner, key) again with the same payload: mostly the last few, so that
                duplicates are often in flight together (held, SPEC §2.3)
  other-owner   a recent key with the same payload by another owner: its own job, never a replay
  mismatch      a recent (owner, key) with a different payload: 409 payload-mismatch
                (unless that payload happened to claim the job first)

and independently carries an upstream fault (upstream.py) or none. Every request has a bounded
timeout. The history holds one line per request: who sent what to which proxy, when, and what
came back: `ok` (2xx), `failed` (an answer proving this request executed nothing: a refused
connection to the proxy, the proxy's 409s and 503 too-many-waiters, the backend's 503), or
`indeterminate` (no answer, a 502/504, 503 store-unavailable: it may or may not have run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from upstream import DELAY_HEADER, FAULT_HEADER, STATUS_HEADER, owner_marker, sha

PATH = "/payments"
OWNER_COUNT = 5  # bearer tokens; the anonymous scope (no Authorization) is one more owner
RECENT_KEYS = 64
HOT_KEYS = 8
# The proxy's answers that prove this request was not forwarded (SPEC §8).
NOT_FORWARDED = frozenset(
    {"payload-mismatch", "request-in-flight", "outcome-unknown", "too-many-waiters"}
)
# (weight, kind)
KINDS = ((0.30, "new"), (0.50, "duplicate"), (0.10, "other-owner"), (0.10, "mismatch"))
# (weight, fault, headers)
FAULTS: tuple[tuple[float, str, dict[str, str]], ...] = (
    (0.72, "none", {}),
    (0.10, "slow-backend", {}),  # the delay is drawn per request
    (0.03, "reset-after-send", {FAULT_HEADER: "reset-after-send"}),
    (0.02, "reset-mid-body", {FAULT_HEADER: "reset-mid-body"}),
    (0.03, "drip-ok", {FAULT_HEADER: "drip-ok"}),
    (0.015, "drip-timeout", {FAULT_HEADER: "drip-timeout"}),
    (0.04, "status-503", {STATUS_HEADER: "503"}),
    (0.02, "status-502", {STATUS_HEADER: "502"}),
    (0.015, "status-504", {STATUS_HEADER: "504"}),
)


def owners(seed: int) -> list[str | None]:
    """The Authorization header of each owner (None: the anonymous scope)."""
    return [f"Bearer soak-{seed}-owner-{i}" for i in range(OWNER_COUNT)] + [None]


def payload(key: str, variant: int) -> bytes:
    """Variant 0 is the intent; variant 1 reuses the key with another amount (a mismatch)."""
    return json.dumps({"amount": 1000 + variant, "currency": "EUR", "reference": key}).encode()


@dataclass
class Plan:
    kind: str
    owner: int
    key: str
    variant: int
    fault: str
    headers: dict[str, str]


class KeySpace:
    def __init__(self, rng: random.Random, owner_count: int) -> None:
        self.rng = rng
        self.owner_count = owner_count
        self.recent: deque[tuple[int, str]] = deque(maxlen=RECENT_KEYS)
        self.counter = 0

    def plan(self) -> Plan:
        rng = self.rng
        kind = _weighted(rng, KINDS) if self.recent else "new"
        if kind == "new":
            self.counter += 1
            owner, key = rng.randrange(self.owner_count), f"soak-{self.counter:07d}"
            self.recent.append((owner, key))
        else:
            pool = list(self.recent)[-HOT_KEYS:] if rng.random() < 0.5 else list(self.recent)
            owner, key = rng.choice(pool)
        variant = 1 if kind == "mismatch" else 0
        if kind == "other-owner":
            owner = (owner + rng.randrange(1, self.owner_count)) % self.owner_count
            self.recent.append((owner, key))
        fault = _weighted(rng, tuple((w, name) for w, name, _ in FAULTS))
        headers = dict(next(h for _, name, h in FAULTS if name == fault))
        if fault == "slow-backend":
            headers[DELAY_HEADER] = f"{rng.uniform(0.3, 2.0):.2f}"
        return Plan(kind, owner, key, variant, fault, headers)


def _weighted(rng: random.Random, choices: tuple[tuple[float, str], ...]) -> str:
    point = rng.random() * sum(weight for weight, _ in choices)
    for weight, name in choices:
        point -= weight
        if point < 0:
            return name
    return choices[-1][1]


def classify(status: int, problem: str | None) -> str:
    if 200 <= status < 300:
        return "ok"
    if problem in NOT_FORWARDED or (problem is None and status == 503):
        return "failed"
    return "indeterminate"


class History:
    """One JSON line per request, written as it completes; `pending` ones are still open."""

    def __init__(self, path: Path, started: float) -> None:
        self.path = path
        self.started = started
        self._out = path.open("w")
        self._ids = 0
        self.pending: dict[int, dict[str, Any]] = {}
        self.counts: dict[str, int] = {}
        self.sent: dict[tuple[str, str], set[int]] = {}  # (owner, key) -> payload variants

    def now(self) -> float:
        return time.monotonic() - self.started

    def invoke(self, record: dict[str, Any]) -> int:
        self._ids += 1
        record.update(id=self._ids, outcome="invoked", invoked_at=round(self.now(), 4))
        self.pending[self._ids] = record
        self.sent.setdefault((record["owner"], record["key"]), set()).add(record["variant"])
        return self._ids

    def complete(self, request_id: int, **fields: Any) -> dict[str, Any]:
        record = self.pending.pop(request_id)
        record.update(fields)
        record["completed_at"] = round(self.now(), 4)
        record["seconds"] = round(record["completed_at"] - record["invoked_at"], 4)
        self.counts[record["outcome"]] = self.counts.get(record["outcome"], 0) + 1
        self._out.write(json.dumps(record, separators=(",", ":")) + "\n")
        return record

    def close(self) -> None:
        for record in self.pending.values():  # never completed: recorded as invoked only
            self._out.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._out.close()


async def send(
    session: aiohttp.ClientSession,
    history: History,
    proxy: str,
    url: str,
    authorization: str | None,
    plan: Plan,
    *,
    timeout: float,
    phase: str = "load",
    worker: int = 0,
) -> dict[str, Any]:
    body = payload(plan.key, plan.variant)
    headers = {"Idempotency-Key": plan.key, "Content-Type": "application/json", **plan.headers}
    if authorization is not None:
        headers["Authorization"] = authorization
    request_id = history.invoke(
        {
            "phase": phase,
            "worker": worker,
            "proxy": proxy,
            "kind": plan.kind,
            "owner": owner_marker(authorization),
            "key": plan.key,
            "variant": plan.variant,
            "payload_sha": sha(body),
            "fault": plan.fault,
        }
    )
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + PATH, data=body, headers=headers) as response:
                content = await response.read()
    except aiohttp.ClientConnectorError as exc:  # nothing was sent: the proxy was not there
        return history.complete(request_id, outcome="failed", error=_error(exc))
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return history.complete(request_id, outcome="indeterminate", error=_error(exc))
    problem = response.headers.get("Idempotency-Error")
    fields: dict[str, Any] = {
        "outcome": classify(response.status, problem),
        "status": response.status,
        "problem": problem,
        "replayed": response.headers.get("Idempotent-Replayed") == "true",
        "job": response.headers.get("Idempotency-Job"),
        "content_type": response.headers.get("Content-Type", "").split(";")[0],
        "body_sha": sha(content),
        "body_bytes": len(content),
    }
    echo = _echo(content)
    if echo is not None:
        fields["echo"] = echo
    return history.complete(request_id, **fields)


def _echo(content: bytes) -> dict[str, Any] | None:
    """The backend's own fields, when the body is the backend's answer."""
    with contextlib.suppress(ValueError):
        data = json.loads(content)
        if isinstance(data, dict) and "nonce" in data:
            fields = ("owner", "key", "job", "attempt", "payload_sha", "executed", "seq")
            return {name: data.get(name) for name in fields}
    return None


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:120] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def run_clients(
    *,
    clients: int,
    proxies: Callable[[], dict[str, str]],
    authorizations: list[str | None],
    history: History,
    rng: random.Random,
    until: float,
    timeout: float,
    think: float,
) -> None:
    """`clients` workers until time.monotonic() reaches `until`; each request bounded."""
    space = KeySpace(rng, len(authorizations))
    connector = aiohttp.TCPConnector(limit=clients * 2, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(number: int) -> None:
            while time.monotonic() < until:
                plan = space.plan()
                name, url = rng.choice(sorted(proxies().items()))
                await send(
                    session,
                    history,
                    name,
                    url,
                    authorizations[plan.owner],
                    plan,
                    timeout=timeout,
                    worker=number,
                )
                await asyncio.sleep(rng.uniform(0, think))

        await asyncio.gather(*(worker(n) for n in range(clients)))
