"""`idemproxy contract check`: which upstreams of each group honour its contract (SPEC §3.4)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from idemproxy.config.settings import load_settings
from idemproxy.proxy.routing import Route, RouteTable
from idemproxy.proxy.upstream.client import UpstreamClient
from idemproxy.proxy.upstream.contract import check_upstream
from idemproxy.proxy.upstream.dial import Dialing
from idemproxy.redact import redact_url


def add_contract_commands(commands: Any) -> None:
    contract = commands.add_parser("contract", help="check fallbacks against a group's contract")
    actions = contract.add_subparsers(required=True, metavar="ACTION")
    check = actions.add_parser("check", help="send the samples to every upstream of each group")
    check.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        default=os.environ.get("IDEMPROXY_CONFIG"),
        required=os.environ.get("IDEMPROXY_CONFIG") is None,
        help="YAML settings file",
    )
    check.add_argument("--route", metavar="PREFIX", help="only the route with this prefix")
    check.set_defaults(run=_check)


def _check(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    routes = [r for r in RouteTable.from_settings(settings).routes if r.gate is not None]
    if args.route is not None:
        routes = [r for r in routes if r.prefix == args.route]
    if not routes:
        print("no route with a contract" + (f" at {args.route}" if args.route else ""))
        return 1
    client = UpstreamClient(
        timeout=settings.upstream_timeout,
        connect_timeout=settings.connect_timeout,
        connections=8,
        keepalive=settings.pool.upstream_keepalive,
        dialing=Dialing.from_settings(settings),
    )
    failed = asyncio.run(_check_routes(client, routes))
    return 1 if failed else 0


async def _check_routes(client: UpstreamClient, routes: list[Route]) -> int:
    await client.open()
    failed = 0
    try:
        for route in routes:
            assert route.gate is not None
            print(f"route {route.prefix} ({len(route.gate.contract.samples)} samples)")
            for upstream in (route.upstream, *route.fallbacks):
                edits = route.header_edits.get(upstream, ())
                problems = await check_upstream(
                    client, upstream, route.gate.contract, edits, route.upstream_timeout
                )
                failed += bool(problems)
                print(f"  {'FAIL' if problems else 'ok  '} {redact_url(upstream)}")
                for problem in problems:
                    print(f"       {problem}")
    finally:
        await client.close()
    return failed
