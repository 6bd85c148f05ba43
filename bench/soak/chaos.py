"""The soak's faults and measurements, each a loop that runs until `stop` is set.

* `ProxySlot`: one proxy "replica", a real `python -m idemproxy serve` process
  (tests/support/processes.py) that can be SIGKILLed and restarted on the same port. Each
  incarnation's PostgreSQL connections carry an `application_name` of their own (`soak-a-3`), so
  that `pg_stat_activity` tells them apart.
* `kill_proxies`: SIGKILL one replica every `every` seconds (drawn at random), restart it after
  a short outage.
* `kill_sessions`: `pg_terminate_backend` on all, or a random half, of one replica's sessions
  (or of both).
* `restart_postgres`: a fast restart of the throwaway PostgreSQL now and then (every third one
  an immediate shutdown: crash recovery on the next start).
* `upstream_outages`: the relay refuses new connections for a moment (after closing its idle
  kept-alive ones), or resets the next new connections as soon as they are accepted.
* `sample`: every few seconds, each replica's open file descriptors and RSS, the proxies'
  connections in `pg_stat_activity` by `application_name`, and the load average.

Every action is an event (seconds since the start, what, details) in `Chaos.events`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from upstream import SteeredRelay

from tests.support.pgserver import ThrowawayPostgres
from tests.support.ports import free_port
from tests.support.processes import ProcessDied, ProxyProcess, child_env

DATABASE = "soak"
START_TRIES = 10


@dataclass
class Chaos:
    started: float
    rng: random.Random
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    events: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    # Held by whatever stops or freezes the database server, and by what must reach it: a
    # restart of a frozen server, or a query to one, would wait for ever.
    database: asyncio.Lock = field(default_factory=asyncio.Lock)

    def now(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def event(self, kind: str, **details: Any) -> None:
        self.events.append({"at": self.now(), "event": kind, **details})

    async def pause(self, low: float, high: float) -> bool:
        """Wait a random while; True when the run is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), self.rng.uniform(low, high))
        return self.stop.is_set()


class ProxySlot:
    def __init__(
        self,
        name: str,
        pg: ThrowawayPostgres,
        args: list[str],
        env: Mapping[str, str],
        logs: Path,
    ) -> None:
        self.name = name
        self.pg = pg
        self.args = args
        self.env = dict(env)
        self.logs = logs
        self.port = free_port()
        self.admin_port = free_port()
        self.incarnation = 0
        self.process: ProxyProcess | None = None
        self.pids: list[int] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def application_name(self) -> str:
        return f"soak-{self.name}-{self.incarnation}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.running

    async def start(self, chaos: Chaos | None = None) -> None:
        """A new incarnation on the same ports; retried while PostgreSQL is down."""
        for attempt in range(1, START_TRIES + 1):
            self.incarnation += 1
            dsn = self.pg.dsn(DATABASE, application_name=self.application_name)
            listen = ["--listen", f"127.0.0.1:{self.port}"]
            admin = ["--admin-listen", f"127.0.0.1:{self.admin_port}"]
            process = ProxyProcess(
                self.application_name,
                [*listen, *admin, "--store", dsn, *self.args],
                self.port,
                self.admin_port,
                self.logs,
                self.logs,
            )
            process.spawn(child_env(self.env))
            began = time.monotonic()
            try:
                await process.wait_ready()
            except (ProcessDied, TimeoutError) as exc:
                process.kill()
                if chaos is not None:
                    chaos.event(
                        "proxy-start-failed",
                        proxy=self.name,
                        attempt=attempt,
                        error=str(exc).splitlines()[0][:200],
                    )
                await asyncio.sleep(1.0)
                continue
            self.process = process
            self.pids.append(process.pid)
            if chaos is not None:
                chaos.event(
                    "proxy-started",
                    proxy=self.name,
                    pid=process.pid,
                    incarnation=self.incarnation,
                    seconds=round(time.monotonic() - began, 3),
                )
            return
        raise RuntimeError(f"proxy {self.name} did not start in {START_TRIES} tries")

    def kill9(self) -> int | None:
        if self.process is None or not self.process.running:
            return None
        pid = self.process.pid
        self.process.kill()  # SIGKILL and reap
        return pid


async def kill_proxies(chaos: Chaos, slot: ProxySlot, *, every: tuple[float, float]) -> None:
    while not await chaos.pause(*every):
        pid = slot.kill9()
        chaos.event("proxy-sigkill", proxy=slot.name, pid=pid, incarnation=slot.incarnation)
        await asyncio.sleep(chaos.rng.uniform(0.5, 3.0))
        await slot.start(chaos)


async def kill_sessions(
    chaos: Chaos, pg: ThrowawayPostgres, slots: list[ProxySlot], *, every: tuple[float, float]
) -> None:
    while not await chaos.pause(*every):
        targets = chaos.rng.choice([[slots[0]], [slots[1]], slots])
        names = {slot.application_name for slot in targets}
        share = chaos.rng.choice(["all", "half"])
        try:
            async with chaos.database:
                rows = await pg.backends(DATABASE)
                pids = [row["pid"] for row in rows if row["application_name"] in names]
                if share == "half":
                    pids = chaos.rng.sample(pids, len(pids) // 2)
                killed = await pg.terminate_backends(pids=pids) if pids else []
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            chaos.event("pg-terminate-skipped", error=type(exc).__name__)
            continue
        chaos.event("pg-terminate", targets=sorted(names), share=share, sessions=len(killed))


async def restart_postgres(
    chaos: Chaos, pg: ThrowawayPostgres, *, every: tuple[float, float]
) -> None:
    count = 0
    while not await chaos.pause(*every):
        count += 1
        mode = "immediate" if count % 3 == 0 else "fast"
        async with chaos.database:
            began = time.monotonic()
            await asyncio.to_thread(pg.restart, mode)
        chaos.event("pg-restart", mode=mode, seconds=round(time.monotonic() - began, 3))


async def freeze_postgres(
    chaos: Chaos, pg: ThrowawayPostgres, *, every: tuple[float, float], seconds: tuple[float, float]
) -> None:
    """SIGSTOP the whole server for a while (a stall longer than the store timeout): claims
    waiting then get 503 and may commit once it runs again (proxy/background/unsent.py releases
    those)."""
    while not await chaos.pause(*every):
        frozen = round(chaos.rng.uniform(*seconds), 2)
        async with chaos.database:
            chaos.event("pg-freeze", seconds=frozen)
            pg.pause()
            try:
                await asyncio.sleep(frozen)
            finally:
                pg.resume()
        chaos.event("pg-thawed")


async def upstream_outages(
    chaos: Chaos, relay: SteeredRelay, *, every: tuple[float, float]
) -> None:
    while not await chaos.pause(*every):
        if chaos.rng.random() < 0.5:
            seconds = round(chaos.rng.uniform(0.5, 2.0), 2)
            chaos.event("upstream-refuse", seconds=seconds)
            closed = await relay.refuse_for(seconds)
            chaos.event("upstream-listening", idle_closed=closed)
        else:
            relay.reset_next_connections(2)
            chaos.event("upstream-reset-on-accept", connections=2)


async def sample(
    chaos: Chaos, pg: ThrowawayPostgres, slots: list[ProxySlot], *, every: float, phase: str
) -> None:
    while True:
        chaos.samples.append(await take_sample(chaos, pg, slots, phase=phase))
        if await chaos.pause(every, every):
            return


async def take_sample(
    chaos: Chaos, pg: ThrowawayPostgres, slots: list[ProxySlot], *, phase: str
) -> dict[str, Any]:
    record: dict[str, Any] = {"at": chaos.now(), "phase": phase, "load": os.getloadavg()}
    for slot in slots:
        if slot.running and slot.process is not None:
            record[slot.name] = {
                "pid": slot.process.pid,
                "incarnation": slot.incarnation,
                "fds": _fds(slot.process.pid),
                "rss_kib": _rss_kib(slot.process.pid),
            }
    try:
        rows = await asyncio.wait_for(
            pg.backends(
                DATABASE,
            ),
            3.0,
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        record["pg_connections"] = None
        record["pg_error"] = type(exc).__name__
    else:
        counts: dict[str, int] = {}
        for row in rows:
            name = row["application_name"] or ""
            counts[name] = counts.get(name, 0) + 1
        record["pg_connections"] = counts
    return record


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
