"""Soak test (issue 8 item 6): mixed traffic under every fault at once, then a verdict.

    .venv/bin/python bench/soak/soak.py [--minutes 10] [--clients 16] [--seed N] [--out DIR]

Two `idemproxy serve` processes share one throwaway PostgreSQL (tests/support/pgserver.py) in
front of a recording backend behind a fault relay (upstream.py); `clients` workers (workload.py)
send mixed traffic to both while chaos.py kills the proxies' database sessions, restarts and freezes
(SIGSTOP) PostgreSQL, SIGKILLs and restarts one proxy (the other one survives the whole run),
and makes the upstream refuse, reset, drip and fail. Then, after a quiet period longer than the
lease, the store is read and every job still `in_flight` past its lease is retried once (it must
be taken over as `unknown`, never forwarded again). The checker (check.py) writes `report.json`
and `report.md` in the results directory (default `bench/results/soak-<UTC time>/`), next to the
raw material: history.jsonl, ledger.jsonl, events.jsonl, samples.jsonl, store-*.json, the
proxies' logs.

Loopback only; the shared PostgreSQL and Redis are never touched. Exit status 0 when every
invariant held, 1 when one did not, 2 when the run itself could not be carried out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.support: the throwaway PostgreSQL, the fault relay, proxies

import aiohttp  # noqa: E402
import asyncpg  # noqa: E402
import chaos  # noqa: E402
import check  # noqa: E402
from upstream import Ledger, SteeredRelay, owner_marker, start_backend  # noqa: E402
from workload import History, Plan, owners, run_clients, send  # noqa: E402

from tests.support.pgserver import ThrowawayPostgres  # noqa: E402

LEASE = 5.0  # seconds
UPSTREAM_TIMEOUT = 3.0  # seconds: drip-timeout is well past it, drip-ok well within
POOL = 8  # pool.store_connections per proxy
STORE_TIMEOUT = 2.0  # pool.store_timeout
CLIENT_TIMEOUT = 20.0  # seconds per request: past max_wait (upstream timeout + 5 s) and retries
QUIET = 2 * LEASE + UPSTREAM_TIMEOUT  # seconds without traffic or faults before the store is read


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="load duration (default 10)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (16)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: time)")
    parser.add_argument("--think", type=float, default=0.05, help="max pause between requests")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--keep-postgres", action="store_true", help="leave its data directory")
    return parser.parse_args(argv)


def proxy_args(relay_url: str) -> list[str]:
    return [
        "--upstream",
        relay_url,
        "--lease",
        str(LEASE),
        "--upstream-timeout",
        str(UPSTREAM_TIMEOUT),
        "--log-level",
        "info",
    ]


PROXY_ENV = {
    "IDEMPROXY_POOL__STORE_CONNECTIONS": str(POOL),
    "IDEMPROXY_POOL__STORE_TIMEOUT": str(STORE_TIMEOUT),
    "IDEMPROXY_SERVER__SHUTDOWN_TIMEOUT": "5",
}


async def main(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else int(time.time())
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out: Path = args.out or REPO / "bench" / "results" / f"soak-{stamp}"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rng = random.Random(seed)
    mayhem = chaos.Chaos(started, random.Random(seed + 1))
    pg = ThrowawayPostgres()
    ledger = Ledger(started)
    runner = relay = None
    slots: list[chaos.ProxySlot] = []
    try:
        await asyncio.to_thread(pg.start)
        await pg.execute(f'CREATE DATABASE "{chaos.DATABASE}"')
        runner, backend_port = await start_backend(ledger)
        relay = SteeredRelay(backend_port)
        await relay.start()
        slots = [
            chaos.ProxySlot(name, pg, proxy_args(relay.url), PROXY_ENV, out / "logs")
            for name in ("a", "b")
        ]
        for slot in slots:  # one after the other: the first one migrates
            await slot.start(mayhem)
        run = describe_run(args, seed, out, pg)
        print(f"soak: {args.minutes} min, {args.clients} clients, seed {seed}, results {out}")
        verdict = await soak(args, out, rng, mayhem, pg, ledger, relay, slots, run)
    finally:
        for slot in slots:
            slot.kill9()
        if relay is not None:
            await relay.close()
        if runner is not None:
            await runner.cleanup()
        with contextlib.suppress(OSError):
            shutil.copy(pg.log_path, out / "logs" / "postgres.log")
        if args.keep_postgres:
            await asyncio.to_thread(pg.stop, "fast")
        else:
            await asyncio.to_thread(pg.destroy)
    return verdict


async def soak(
    args: argparse.Namespace,
    out: Path,
    rng: random.Random,
    mayhem: chaos.Chaos,
    pg: ThrowawayPostgres,
    ledger: Ledger,
    relay: SteeredRelay,
    slots: list[chaos.ProxySlot],
    run: dict[str, Any],
) -> int:
    history = History(out / "history.jsonl", mayhem.started)
    authorizations = owners(run["seed"])
    duration = args.minutes * 60
    load_until = time.monotonic() + duration
    faults = [
        chaos.sample(mayhem, pg, slots, every=5.0, phase="load"),
        # Shorter runs than 10 minutes still see every fault more than once.
        chaos.kill_proxies(mayhem, slots[0], every=_within(duration, 30.0, 60.0)),
        chaos.kill_sessions(mayhem, pg, slots, every=(8.0, 20.0)),
        chaos.restart_postgres(mayhem, pg, every=_within(duration, 100.0, 160.0)),
        # Longer than the store timeout: the claims waiting get 503 and commit afterwards.
        chaos.freeze_postgres(
            mayhem,
            pg,
            every=_within(duration, 40.0, 80.0),
            seconds=(STORE_TIMEOUT + 0.5, 2 * STORE_TIMEOUT),
        ),
        chaos.upstream_outages(mayhem, relay, every=(15.0, 30.0)),
    ]
    tasks = [asyncio.create_task(fault) for fault in faults]
    try:
        await run_clients(
            clients=args.clients,
            proxies=lambda: {slot.name: slot.url for slot in slots},
            authorizations=authorizations,
            history=history,
            rng=rng,
            until=load_until,
            timeout=CLIENT_TIMEOUT,
            think=args.think,
        )
        run["load_ended_at"] = mayhem.now()
    finally:
        mayhem.stop.set()
        await asyncio.gather(*tasks)  # every loop finishes its current action, then returns
    mayhem.event("load-ended", pending=len(history.pending))

    # The end: everything healthy, then quiet for longer than the lease.
    if not pg.running:
        await asyncio.to_thread(pg.start)
    for slot in slots:
        if not slot.running:
            await slot.start(mayhem)
    await asyncio.sleep(QUIET)
    mayhem.samples.append(await chaos.take_sample(mayhem, pg, slots, phase="after-quiet"))
    store_end = await snapshot(pg)
    write_json(out / "store-end.json", store_end)
    run["final_phase_started_at"] = mayhem.now()
    await take_over_stale(store_end, history, slots[1], authorizations)
    await asyncio.sleep(1.0)
    write_json(out / "store-final.json", await snapshot(pg))
    mayhem.samples.append(await chaos.take_sample(mayhem, pg, slots, phase="final"))
    for slot in slots:
        (out / f"metrics-{slot.name}.txt").write_text(await scrape(slot))
    run["exits"] = {}
    for slot in slots:
        assert slot.process is not None
        began = time.monotonic()
        code = await slot.process.terminate(timeout=30.0)
        run["exits"][slot.name] = {"code": code, "seconds": round(time.monotonic() - began, 2)}
    run["ended_at"] = mayhem.now()
    run["load_end"] = os.getloadavg()
    run["proxy_pids"] = {slot.name: slot.pids for slot in slots}
    run["relay"] = {"applied": dict(relay.applied), "resets_on_accept_left": relay.resets_pending}
    history.close()
    ledger.write(out / "ledger.jsonl")
    write_lines(out / "events.jsonl", mayhem.events)
    write_lines(out / "samples.jsonl", mayhem.samples)
    write_json(out / "run.json", run)
    report = check.check_dir(out)
    print(check.summary_line(report))
    return 0 if report["passed"] else 1


def _within(duration: float, low: float, high: float) -> tuple[float, float]:
    """(low, high) seconds, or less when the run would see the fault fewer than 3 times."""
    scale = min(1.0, duration / (3.5 * high))
    return low * scale, high * scale


async def take_over_stale(
    store: dict[str, Any], history: History, slot: chaos.ProxySlot, authorizations: list[str | None]
) -> None:
    """Retry once, with each payload it was sent with, every job still in flight past its lease:
    the next request must take it over as unknown (SPEC §3.5) and forward nothing."""
    by_marker = {owner_marker(a): a for a in authorizations}
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for job in store["jobs"]:
            if job["state"] != "in_flight":
                continue
            marker = check.marker_of_store_owner(job["owner"])
            for variant in sorted(history.sent.get((marker, job["key"]), {0})):
                plan = Plan("final", 0, job["key"], variant, "none", {})
                await send(
                    session,
                    history,
                    slot.name,
                    slot.url,
                    by_marker[marker],
                    plan,
                    timeout=CLIENT_TIMEOUT,
                    phase="final",
                )


async def snapshot(pg: ThrowawayPostgres) -> dict[str, Any]:
    """Every job and attempt, with lease times by the database's clock."""
    conn = await asyncpg.connect(
        pg.dsn(chaos.DATABASE, application_name="soak-checker"), timeout=10
    )
    try:
        jobs = await conn.fetch(
            "SELECT owner, key, id::text AS id, state, version, attempt_count, completed_by,"
            " response_status, left(encode(sha256(response_body), 'hex'), 32) AS body_sha,"
            " resolution, extract(epoch FROM lease_expires_at - now())::float AS lease_left"
            " FROM idemproxy.jobs ORDER BY created_at"
        )
        attempts = await conn.fetch(
            "SELECT owner, job_id::text AS job, number, state, status, error"
            " FROM idemproxy.attempts ORDER BY job_id, number"
        )
        clock = await conn.fetchval("SELECT now()::text")
    finally:
        await conn.close()
    return {
        "db_now": clock,
        "jobs": [dict(row) for row in jobs],
        "attempts": [dict(row) for row in attempts],
    }


async def scrape(slot: chaos.ProxySlot) -> str:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"http://127.0.0.1:{slot.admin_port}/metrics") as response,
        ):
            return await response.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"# scrape failed: {exc!r}\n"


def describe_run(
    args: argparse.Namespace, seed: int, out: Path, pg: ThrowawayPostgres
) -> dict[str, Any]:
    def git(*command: str) -> str:
        done = subprocess.run(
            ["git", *command], check=False, cwd=REPO, capture_output=True, text=True
        )
        return done.stdout.strip()

    return {
        "seed": seed,
        "minutes": args.minutes,
        "clients": args.clients,
        "think": args.think,
        "lease": LEASE,
        "upstream_timeout": UPSTREAM_TIMEOUT,
        "pool": POOL,
        "store_timeout": STORE_TIMEOUT,
        "client_timeout": CLIENT_TIMEOUT,
        "quiet": QUIET,
        "results": str(out),
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_head": git("rev-parse", "--short", "HEAD"),
        "git_dirty_src": git("status", "--porcelain", "--", "src").splitlines(),
        "cpus": os.cpu_count(),
        "load_start": os.getloadavg(),
        "postgres": str(pg.bindir),
        "python": sys.version.split()[0],
    }


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("w") as out:
        for record in records:
            out.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        sys.exit(asyncio.run(main(parse_args())))
    sys.exit(uvloop.run(main(parse_args())))
